"""The `shoal` command line: `shoal chat` (interactive, streaming), `shoal generate PROMPT...`, the
servers (`worker`, `router`, `serve`, `stage`), cluster control (`status`, `restart`), `shoal bench` and
`shoal simulate`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.bench.options import add_bench_arguments
from shoal.config.engine_arguments import add_engine_config_arguments, engine_config_from_arguments
from shoal.model.cpu_features import apply_cpu_isa_cap
from shoal.observability.logging import FORMAT_VARIABLE, configure_logging
from shoal.protocol.worker_load import Role
from shoal.simulate.options import add_simulate_arguments

if TYPE_CHECKING:  # the engine (and torch) load only for the commands that run one
    from shoal.engine.engine import LLMEngine
    from shoal.engine.sampling_params import SamplingParams


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)


def _engine(args: argparse.Namespace) -> LLMEngine:
    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))


def _params(args: argparse.Namespace) -> SamplingParams:
    from shoal.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def stream(engine: LLMEngine, request_id: str, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Runs one request on a synchronous engine, yielding text deltas as they are decoded."""
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.new_text:
                yield output.new_text


def chat(args: argparse.Namespace) -> int:
    """A terminal conversation: with a running cluster (`--url`, over the Responses API), else with
    a model loaded here."""
    if args.url:
        from shoal.cluster.remote_chat import ChatError, RemoteChat

        remote = RemoteChat(args.url, args.model, args.api_key, args.temperature, args.max_tokens)
        print(f"shoal chat with {args.model} at {args.url}; an empty line or Ctrl-D ends.", flush=True)
        return _converse(remote.turn, ChatError)
    engine = _engine(args)
    tokenizer = engine.tokenizer
    messages: list[dict[str, str]] = []

    def local_turn(line: str) -> Iterator[str]:
        messages.append({"role": "user", "content": line})
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        reply = []
        for delta in stream(engine, f"chat-{len(messages)}", prompt_ids, _params(args)):
            reply.append(delta)
            yield delta
        messages.append({"role": "assistant", "content": "".join(reply)})

    print(f"shoal chat on {args.model} ({engine.dtype}, {engine.device}); an empty line or Ctrl-D ends.", flush=True)
    return _converse(local_turn, RuntimeError)


def _converse(turn: Callable[[str], Iterator[str]], failure: type[Exception]) -> int:
    """Reads lines until an empty one or end of input, printing each reply as it streams; a failed
    turn is reported and the conversation goes on."""
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        try:
            for delta in turn(line):
                print(delta, end="", flush=True)
        except failure as exc:
            print(f"\n[{exc}]", end="", file=sys.stderr, flush=True)
        print(flush=True)


def generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    for i, prompt in enumerate(args.prompts):
        for delta in stream(engine, f"gen-{i}", prompt, _params(args)):
            print(delta, end="", flush=True)
        print(flush=True)
    return 0


def worker(args: argparse.Namespace) -> int:
    import uvicorn

    from shoal.engine.startup import start_engine
    from shoal.model.weight_cache import default_cache_dir
    from shoal.observability.tracing import Tracing
    from shoal.worker.admission import AdmissionLimits
    from shoal.worker.drain import DrainingServer, DrainState
    from shoal.worker.server import RouterLink, create_app

    configure_logging()
    try:
        config = engine_config_from_arguments(args)
    except ValueError as exc:
        print(f"shoal worker: invalid engine configuration: {exc}", file=sys.stderr)
        return 2
    async_engine, calibration = start_engine(config, Path(config.cache_dir or default_cache_dir()), _exit_failed)
    logging.getLogger("shoal.worker").info("calibrated: %s", calibration.as_dict())
    drain = DrainState()
    limits = AdmissionLimits(max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests)
    routers = []
    advertised = args.advertise_url or f"http://{args.host}:{args.port}"
    if args.router:
        secret = os.environ.get("SHOAL_CLUSTER_SECRET")
        if not secret:
            print("shoal worker: --router needs the cluster secret in $SHOAL_CLUSTER_SECRET", file=sys.stderr)
            return 2
        routers = [RouterLink(url, advertised, secret) for url in args.router]
    tracing = Tracing("shoal-worker", args.otlp_endpoint, instance=advertised)
    app = create_app(
        async_engine,
        args.served_model_name or config.model,
        drain,
        calibration,
        limits,
        routers,
        tracing,
        role=args.role,
        kv_peer_host=args.host,
        advertise_host=urllib.parse.urlparse(advertised).hostname,
    )
    # Past the drain's grace, responses still open are cut (a router continues them elsewhere).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=1)
    DrainingServer(config, drain, args.drain_grace_s).run()
    async_engine.shutdown()  # the engine thread must not be inside torch when the interpreter exits
    return 0


def stage(args: argparse.Namespace) -> int:
    from shoal.parallel.pipeline_stage import serve_stage

    configure_logging()
    serve_stage(args.bind, persistent=True, num_threads=args.num_threads)
    return 0


def _exit_failed(reason: str) -> None:
    """A replica that lost one of its processes exits at once: its open streams break, so the router
    moves them elsewhere, and its supervisor starts the whole replica again."""
    logging.getLogger("shoal.worker").critical("replica failed (%s); exiting", reason)
    logging.shutdown()
    os._exit(70)


def router(args: argparse.Namespace) -> int:
    from shoal.router.config import RouterConfig
    from shoal.router.group_runner import serve_router

    configure_logging()
    overrides = {
        k: v
        for k, v in {"host": args.host, "port": args.port, "policy": args.policy, "processes": args.processes}.items()
        if v is not None
    }
    if args.worker:
        overrides["workers"] = [{"url": url} for url in args.worker]
    try:
        config = RouterConfig.from_file(args.config, **overrides) if args.config else RouterConfig(**overrides)
    except (ValueError, OSError) as exc:
        print(f"shoal router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return serve_router(config)


def serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from shoal.cluster.config import DeploymentConfig, ModelDeployment, describe
    from shoal.cluster.serve import serve as run

    configure_logging()
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    try:
        config = DeploymentConfig.from_file(args.config, **overrides) if args.config else DeploymentConfig(**overrides)
        if args.model or args.workers is not None:  # one model, from the flags
            first = config.models[0]
            model = args.model or first.model
            replicas = first.replicas if args.workers is None else args.workers
            name = first.name if not args.model else Path(args.model).name.removesuffix(".gguf")
            config = config.model_copy(update={"models": [ModelDeployment(name=name, model=model, replicas=replicas)]})
    except ValidationError as exc:
        print(f"shoal serve: invalid configuration:\n{describe(exc)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"shoal serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return run(config)


def status(args: argparse.Namespace) -> int:
    from shoal.cluster.status import status as show

    return show(args.state_dir)


def restart(args: argparse.Namespace) -> int:
    from shoal.cluster.status import restart as rolling_restart

    return rolling_restart(args.state_dir, args.model)


def bench(args: argparse.Namespace) -> int:
    from shoal.bench.command import run

    return run(args)


def inspect(args: argparse.Namespace) -> int:
    """Prints what a model is and whether shoal runs it, without loading its weights; 1 if it does not."""
    import json

    from shoal.model.errors import ModelLoadError
    from shoal.model.inspection import inspect_model

    try:
        report = inspect_model(args.model)
    except ModelLoadError as exc:
        print(f"shoal inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.summary()))
    else:
        print("\n".join(report.lines()))
    return 0 if report.config is not None else 1


def simulate(args: argparse.Namespace) -> int:
    from shoal.simulate.command import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description="Distributed LLM inference.")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="log lines as text or JSON with request and trace ids (default: $SHOAL_LOG_FORMAT, "
        "else text); processes started by this one log the same way",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    chat_parser = commands.add_parser("chat", help="chat in the terminal, with a running cluster or a model here")
    _engine_args(chat_parser)
    chat_parser.add_argument(
        "--url", default=None, help="a shoal router (or any Responses API server); --model is then the served name"
    )
    chat_parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="for --url (default: $OPENAI_API_KEY)"
    )
    chat_parser.set_defaults(run=chat)
    gen_parser = commands.add_parser("generate", help="complete prompts and print the results")
    _engine_args(gen_parser)
    gen_parser.add_argument("prompts", nargs="+")
    gen_parser.set_defaults(run=generate)
    worker_parser = commands.add_parser("worker", help="serve one replica over OpenAI-compatible HTTP")
    add_engine_config_arguments(worker_parser)
    worker_parser.add_argument("--host", default="127.0.0.1")
    worker_parser.add_argument("--port", type=int, default=8000)
    worker_parser.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="larger request bodies are refused with 413"
    )
    worker_parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="beyond this many queued requests, new ones get 503 + Retry-After",
    )
    worker_parser.add_argument("--served-model-name", default=None)
    worker_parser.add_argument(
        "--drain-grace-s", type=float, default=30.0, help="on SIGTERM, how long in-flight requests may take to finish"
    )
    worker_parser.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="URL",
        help="register with this router and heartbeat (secret from $SHOAL_CLUSTER_SECRET); "
        "repeat for redundant routers",
    )
    worker_parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export traces over OTLP/HTTP (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)",
    )
    worker_parser.add_argument(
        "--advertise-url", default=None, help="the URL the router should use for this worker (default http://HOST:PORT)"
    )
    worker_parser.add_argument(
        "--role",
        choices=typing.get_args(Role),
        default="colocated",
        help="prefill: hand each stream to a decode worker after its first token, with its KV",
    )
    worker_parser.set_defaults(run=worker)
    router_parser = commands.add_parser("router", help="one OpenAI endpoint in front of many workers")
    router_parser.add_argument("--host", default=None)
    router_parser.add_argument("--port", type=int, default=None)
    router_parser.add_argument("--worker", action="append", metavar="URL", help="a worker to poll (repeatable)")
    router_parser.add_argument(
        "--policy",
        default=None,
        help="cost (default), round_robin, least_outstanding_tokens, power_of_two, cache_aware, session_affinity",
    )
    router_parser.add_argument(
        "--processes", type=int, default=None, help="router processes sharing the port (router.processes)"
    )
    router_parser.add_argument("--config", default=None, help="YAML file with every router setting")
    router_parser.set_defaults(run=router)
    serve_parser = commands.add_parser(
        "serve", help="a router and supervised workers from one config (default: 2 workers of the bundled SmolLM2)"
    )
    serve_parser.add_argument("--config", default=None, help="YAML deployment config (see examples/)")
    serve_parser.add_argument("--host", default=None)
    serve_parser.add_argument("--port", type=int, default=None)
    serve_parser.add_argument("--model", default=None, help="serve this one model (registry name, .gguf, HF dir)")
    serve_parser.add_argument("--workers", type=int, default=None, help="replicas of that model")
    serve_parser.set_defaults(run=serve)
    status_parser = commands.add_parser("status", help="the cluster a running `shoal serve` supervises")
    status_parser.add_argument("--state-dir", default="~/.local/state/shoal")
    status_parser.set_defaults(run=status)
    restart_parser = commands.add_parser("restart", help="replace a model's replicas one by one (rolling restart)")
    restart_parser.add_argument("model")
    restart_parser.add_argument("--state-dir", default="~/.local/state/shoal")
    restart_parser.set_defaults(run=restart)
    stage_parser = commands.add_parser("stage", help="a pipeline stage server, given its layers by a worker's --stage")
    stage_parser.add_argument(
        "--bind",
        default="tcp://127.0.0.1:7100",
        help="ZeroMQ address of its inbox (default: loopback only; e.g. tcp://10.0.0.5:7100 for "
        "heads on other machines); peers need the cluster secret in $SHOAL_CLUSTER_SECRET",
    )
    stage_parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of this stage (default: the head's setting, else every core)",
    )
    stage_parser.set_defaults(run=stage)
    bench_parser = commands.add_parser(
        "bench", help="load an OpenAI-compatible server; report latency, throughput and goodput"
    )
    add_bench_arguments(bench_parser)
    bench_parser.set_defaults(run=bench)
    inspect_parser = commands.add_parser(
        "inspect", help="what a model is (family, parameters, tensor types, KV bytes) and whether it runs here"
    )
    inspect_parser.add_argument("model", help="a built-in model name, a .gguf file or a Hugging Face directory")
    inspect_parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    inspect_parser.set_defaults(run=inspect)
    simulate_parser = commands.add_parser(
        "simulate", help="simulate a fleet behind the router's policies; compare them at any scale"
    )
    add_simulate_arguments(simulate_parser)
    simulate_parser.set_defaults(run=simulate)
    args = parser.parse_args(argv)
    if args.log_format:
        os.environ[FORMAT_VARIABLE] = args.log_format
    try:  # before torch runs anything; the processes this one starts inherit the cap
        apply_cpu_isa_cap()
    except ValueError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
