"""How an engine runs: EngineConfig and its command-line form. A leaf of the engine stack that
imports neither torch nor the engine, so the deployment config builds it and every layer reads it."""
