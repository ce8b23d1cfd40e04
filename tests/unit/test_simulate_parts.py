"""`shoal simulate`'s parts: the step-cost model, fleet specs, CPU sharing, the token model and the
cached membership views."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.lengths import Fixed, Uniform
from shoal.bench.workloads import WorkloadConfig, build_workload
from shoal.simulate.calibration import WorkerFigures, average, read_figures
from shoal.simulate.cost_model import (
    CALIBRATION_PROMPT_TOKENS,
    CalibrationFigures,
    StepCost,
)
from shoal.simulate.events import EventLoop
from shoal.simulate.fleet import FleetSpec, WorkerClass, load_fleet, parse_mix
from shoal.simulate.host import Host
from shoal.simulate.tokens import sim_requests


@pytest.mark.parametrize(
    "figures",
    [
        CalibrationFigures(418.0, 13.4, 97.2, 8),  # memory-bound batch (SmolLM2 on one core)
        CalibrationFigures(1000.0, 50.0, 60.0, 8),  # compute-bound batch
        CalibrationFigures(23000.0, 1250.0, 8150.0, 8),
    ],
)
def test_the_step_cost_reproduces_the_calibration_it_comes_from(figures):
    cost = StepCost.from_calibration(figures)
    prompt = CALIBRATION_PROMPT_TOKENS
    assert cost.seconds(prompt, 0) == pytest.approx(prompt / figures.prefill_tokens_per_s)
    assert cost.seconds(0, 1) == pytest.approx(1 / figures.decode_tokens_per_s)
    assert cost.seconds(0, figures.batch) == pytest.approx(figures.batch / figures.batched_decode_tokens_per_s)
    assert min(cost.floor_s, cost.token_s, cost.seq_s) >= 0


def test_a_faster_worker_takes_proportionally_less_time_per_step():
    cost = StepCost(0.05, 0.002, 0.001)
    assert cost.scaled(4).seconds(300, 5) == pytest.approx(cost.seconds(300, 5) / 4)
    assert cost.seconds(10, 2) == pytest.approx(0.05 + 2 * 0.001)  # under the floor
    assert cost.seconds(500, 2) == pytest.approx(502 * 0.002 + 2 * 0.001)  # compute-bound


def test_calibration_figures_come_from_a_load_report_or_a_bare_calibration():
    calibration = {
        "prefill_tokens_per_s": 400.0,
        "decode_tokens_per_s": 20.0,
        "batched_decode_tokens_per_s": 100.0,
        "batch": 8,
        "seconds": 2.0,
        "capability": 100.0,
    }
    report = WorkerFigures.from_report(
        {"calibration": calibration, "num_kv_blocks": 100, "block_size": 16, "max_num_seqs": 32, "max_model_len": 2048},
        "a worker",
    )
    assert (report.kv_tokens, report.max_num_seqs, report.max_model_len) == (1600, 32, 2048)
    assert WorkerFigures.from_report(calibration, "a file").calibration == report.calibration
    with pytest.raises(ValueError, match="calibration"):
        WorkerFigures.from_report({"calibration": None}, "a worker without one")
    with pytest.raises(ValueError, match="batched_decode_tokens_per_s"):
        WorkerFigures.from_report({"prefill_tokens_per_s": 1.0}, "a file")


def test_a_serving_worker_is_taken_at_the_speeds_its_moving_averages_show():
    calibration = CalibrationFigures(400.0, 20.0, 100.0, 8)
    cost = StepCost.from_calibration(calibration)
    # A fresh worker's averages are seeded from its calibration: nothing changes.
    seeded = {"prefill_tokens_per_s": 400.0, "decode_tokens_per_s": 100.0, "decode_step_s": 8 / 100.0}
    assert calibration.rescaled(**seeded) == pytest.approx(calibration)
    # Steps of 4 sequences taking 1.5 times the calibrated time: every decode figure is 1.5 times slower.
    slower = calibration.rescaled(
        prefill_tokens_per_s=300.0,
        decode_step_s=1.5 * cost.seconds(0, 4),
        decode_tokens_per_s=4 / (1.5 * cost.seconds(0, 4)),
    )
    assert slower.prefill_tokens_per_s == 300.0
    assert slower.decode_tokens_per_s == pytest.approx(20.0 / 1.5)
    assert slower.batched_decode_tokens_per_s == pytest.approx(100.0 / 1.5)
    report = {
        "calibration": calibration.as_dict(),
        "prefill_tokens_per_s": 300.0,
        "decode_step_s": 1.5 * cost.seconds(0, 4),
        "decode_tokens_per_s": 4 / (1.5 * cost.seconds(0, 4)),
    }
    assert WorkerFigures.from_report(report, "w").calibration == slower


def test_figures_are_read_from_a_workers_load_endpoint_or_a_saved_report(tmp_path):
    report = {
        "calibration": {
            "prefill_tokens_per_s": 400.0,
            "decode_tokens_per_s": 20.0,
            "batched_decode_tokens_per_s": 100.0,
            "batch": 8,
        },
        "num_kv_blocks": 64,
        "block_size": 16,
    }

    class LoadHandler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(report).encode() if self.path == "/load" else b"{}"
            self.send_response(200 if self.path == "/load" else 404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), LoadHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert read_figures(url).kv_tokens == 1024
        assert read_figures(url + "/load/").calibration == read_figures(url).calibration
    finally:
        server.shutdown()
    saved = tmp_path / "load.json"
    saved.write_text(json.dumps(report))
    assert read_figures(str(saved)).calibration == CalibrationFigures(400.0, 20.0, 100.0, 8)
    saved.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_figures(str(saved))


def test_several_workers_average_into_one_typical_worker():
    figures = [
        WorkerFigures(CalibrationFigures(400.0, 20.0, 100.0, 8), kv_tokens=1000, source="a"),
        WorkerFigures(CalibrationFigures(600.0, 30.0, 140.0, 8), kv_tokens=2000, source="b"),
    ]
    mean = average(figures)
    assert mean.calibration == CalibrationFigures(500.0, 25.0, 120.0, 8)
    assert mean.kv_tokens == 1000 and "a" in mean.source and "b" in mean.source
    assert average(figures[:1]) == figures[0]


def test_a_mix_gives_classes_in_proportion_that_add_up():
    classes = parse_mix("fast:0.2:speed=4,kv=200000;slow:0.8:speed=1,kv=50000,mtbf=600")
    assert [c.name for c in classes] == ["fast", "slow"]
    assert classes[0].speed == 4 and classes[0].kv == 200000 and classes[1].mtbf == 600
    assert FleetSpec(1000, classes).counts() == {"fast": 200, "slow": 800}
    assert FleetSpec(7, classes).counts() == {"fast": 1, "slow": 6}
    assert sum(FleetSpec(3, parse_mix("a:1;b:1;c:1;d:1")).counts().values()) == 3


@pytest.mark.parametrize(
    "mix, message",
    [
        ("fast:0.2:speed=4,colour=red", "unknown worker class keys"),
        ("fast", "NAME:FRACTION"),
        ("fast:0.2:speed", "KEY=VALUE"),
        ("fast:0:speed=1", "above 0"),
        ("fast:1:kv=lots", "not a number"),
        ("a:1;a:1", "distinct names"),
    ],
)
def test_a_bad_mix_is_refused_with_the_reason(mix, message):
    with pytest.raises(ValueError, match=message):
        FleetSpec(10, parse_mix(mix))


def test_a_fleet_file_says_the_same_as_a_mix(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "workers: 10\nclasses:\n  - {name: fast, fraction: 0.2, speed: 4, kv: 200000}\n"
        "  - {name: slow, fraction: 0.8, kv: 50000}\n"
    )
    assert load_fleet(path) == FleetSpec(10, parse_mix("fast:0.2:speed=4,kv=200000;slow:0.8:kv=50000"))
    assert load_fleet(path, workers=20).workers == 20
    path.write_text("workers: 10\nnodes: 3\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_fleet(path)


def test_expanded_workers_carry_their_class_and_the_calibration_where_the_class_is_silent():
    figures = WorkerFigures(CalibrationFigures(400.0, 20.0, 100.0, 8), kv_tokens=4096, max_num_seqs=16)
    fleet = FleetSpec(4, (WorkerClass("fast", 1, speed=2, kv=8192), WorkerClass("cpu", 1, per_host=2, cores=1)))
    specs = fleet.expand(figures)
    assert [s.worker_class for s in specs] == ["fast", "fast", "cpu", "cpu"]
    assert specs[0].kv_tokens == 8192 and specs[2].kv_tokens == 4096 and specs[0].max_num_seqs == 16
    assert specs[0].calibration.prefill_tokens_per_s == 800.0
    assert specs[0].cost == StepCost.from_calibration(figures.calibration).scaled(2)
    assert specs[0].host != specs[1].host and specs[2].host == specs[3].host and specs[2].host_cores == 1


def test_steps_on_a_shared_host_slow_each_other_down_while_they_overlap():
    loop = EventLoop()
    host = Host("h", cores=2, loop=loop)
    done: dict[str, float] = {}
    for name in ("a", "b", "c"):
        host.start(name, 1, 1.0, lambda name=name: done.setdefault(name, loop.now))
    loop.run()
    assert done == pytest.approx({"a": 1.5, "b": 1.5, "c": 1.5})  # three threads on two cores

    loop, done = EventLoop(), {}
    host = Host("h", cores=2, loop=loop)
    host.start("a", 1, 1.0, lambda: done.setdefault("a", loop.now))
    host.start("b", 1, 1.0, lambda: done.setdefault("b", loop.now))
    loop.at(0.5, lambda: host.start("c", 1, 0.3, lambda: done.setdefault("c", loop.now)))
    loop.run()
    # From 0.5 s, three steps share two cores: c's 0.3 s of work takes 0.45 s, a and b finish later.
    assert done["c"] == pytest.approx(0.95)
    assert done["a"] == pytest.approx(0.5 + 0.45 + (1.0 - 0.5 - 0.3)) and done["b"] == done["a"]


def test_a_turn_extends_the_previous_turns_prompt_and_output_token_for_token():
    workload = build_workload(
        WorkloadConfig("multi-turn", 12, Uniform(5, 30), Uniform(3, 12), system_prompt_tokens=20, turns=3),
        ArrivalProcess("closed", concurrency=2),
    )
    requests = {(r.conversation_id, r.turn): r for r in sim_requests(workload)}
    for (conversation, turn), request in requests.items():
        assert request.prompt_tokens == workload[request.index].prompt_tokens
        following = requests.get((conversation, turn + 1))
        if following:
            prefix = request.prompt_token_ids() + [request.output_token_id(i) for i in range(request.max_tokens)]
            assert following.prompt_token_ids()[: len(prefix)] == prefix
    first = [r.prompt_token_ids() for r in requests.values() if r.turn == 0]
    assert len({tuple(ids[:24]) for ids in first}) == 1  # the shared system prompt (20 words + 4)
    assert len({tuple(ids[24:]) for ids in first}) == len(first)


def test_single_turn_requests_have_outputs_of_their_own():
    workload = build_workload(
        WorkloadConfig("synthetic", 5, Fixed(8), Fixed(4)), ArrivalProcess("closed", concurrency=1)
    )
    requests = sim_requests(workload)
    outputs = {r.output_token_id(0) for r in requests}
    assert len(outputs) == 5 and not outputs & {t for r in requests for t in r.prompt_token_ids()}
