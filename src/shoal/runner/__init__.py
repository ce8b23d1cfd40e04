"""How one forward pass runs: the model with its KV cache (ModelRunner), the step batch it is given,
the device and dtype an engine config resolves to, and how many KV blocks a memory budget buys.
Below the parallel runners and the engine; above the model."""
