"""Edge SD planning round (shared/edge_sd/plan.py): request validation, telemetry -> runtime and alpha with
their sources, eq. 27 vs uniform shares, Algorithm 1 vs max batching, eq. 7's l vs a fixed l."""

from __future__ import annotations

import copy
import math

import pytest

from shared.edge_sd.bandwidth import upload_times
from shared.edge_sd.batching import EdgeCosts, dp_batching, max_batching
from shared.edge_sd.plan import InfeasibleBatchingError, plan_round
from shared.edge_sd.plan_inputs import (
    MAX_TASKS,
    EdgeTelemetry,
    EdgeTelemetryError,
    PlanDefaults,
    PlanRequest,
    PlanRequestError,
)
from shared.edge_sd.runtime import ModelShape, RuntimeModel
from shared.specdec.picospec_model import alpha_from_verdicts

DRAFT = {"layers": 4, "hidden": 256, "ffn": 1024}
TARGET = {"layers": 8, "hidden": 1024, "ffn": 4096}
DRAFT_RUNTIME = RuntimeModel(c1=2e-12, c2=1e-3)  # the hardware the telemetry below was "measured" on
VERIFY_RUNTIME = RuntimeModel(c1=1e-13, c2=2e-2)
DEFAULTS = PlanDefaults(min_samples=4)
# (input, output, snr dB): mixed prompt lengths and channels, so eq. 27 and Algorithm 1 have work to do.
TASKS = [(300, 40, 5.0), (20, 40, 30.0), (280, 40, 12.0), (25, 40, 0.0), (150, 40, 20.0), (30, 40, 25.0)]


def body(**overrides: object) -> dict:
    base = {
        "tasks": [{"input_tokens": i, "output_tokens": o, "snr_db": snr} for i, o, snr in TASKS],
        "draft_shape": DRAFT,
        "target_shape": TARGET,
        "memory_budget_bytes": 10**9,
        "bandwidth_hz": 1e6,
        "bits_per_token": 16.0 * (256 + 1024),
    }
    base.update(overrides)
    return base


def request(**overrides: object) -> PlanRequest:
    return PlanRequest.from_dict(body(**overrides))


def measured(count: int = 8, verdicts: list[tuple[int, int]] | None = None) -> EdgeTelemetry:
    """Passes exactly on the runtime lines above, at `count` distinct F*b."""
    draft = [(b, 1e8 * (k + 1), DRAFT_RUNTIME.seconds(b, 1e8 * (k + 1))) for k, b in enumerate(range(1, count + 1))]
    verify = [(b, 1e9 * (k + 1), VERIFY_RUNTIME.seconds(b, 1e9 * (k + 1))) for k, b in enumerate(range(1, count + 1))]
    return EdgeTelemetry(draft, verify, verdicts if verdicts is not None else [(4, 4), (4, 2), (4, 3), (4, 0)] * 2)


def costs(
    plan_request: PlanRequest, spec_len: int, alpha: float, draft: RuntimeModel, verify: RuntimeModel
) -> EdgeCosts:
    return EdgeCosts(
        plan_request.draft_shape,
        plan_request.target_shape,
        draft,
        verify,
        spec_len,
        alpha,
        plan_request.memory_budget_bytes,
    )


def task_pairs(plan_request: PlanRequest) -> list[tuple[int, int]]:
    return [(t.input_tokens, t.output_tokens) for t in plan_request.tasks]


def test_without_telemetry_every_measured_input_is_the_default_and_says_why() -> None:
    plan = plan_round(request(), None, DEFAULTS, telemetry_failure="monitor-unreachable").as_dict()
    assert plan["sources"] == {
        "tasks": "request",
        "snr_db": "request",
        "alpha": "default:monitor-unreachable",
        "draft_runtime": "default:monitor-unreachable",
        "verify_runtime": "default:monitor-unreachable",
        "spec_len": "eq7",
        "batching": "algorithm1",
        "shares": "eq27",
    }
    assert plan["alpha"] == DEFAULTS.alpha
    assert plan["draft_runtime"] == {"c1": DEFAULTS.draft_c1, "c2": DEFAULTS.draft_c2}
    assert plan["verify_runtime"] == {"c1": DEFAULTS.verify_c1, "c2": DEFAULTS.verify_c2}
    assert plan_round(request(), None, DEFAULTS).sources["alpha"] == "default:no-telemetry"
    # an already prefixed reason is not prefixed twice
    assert plan_round(request(), None, DEFAULTS, "default:monitor-error").sources["alpha"] == "default:monitor-error"


def test_sources_switch_to_telemetry_once_enough_samples() -> None:
    few = plan_round(request(), measured(count=3, verdicts=[(4, 4)] * 3), DEFAULTS)
    assert (few.sources["alpha"], few.sources["draft_runtime"], few.sources["verify_runtime"]) == (
        "default:few-samples",
    ) * 3
    assert few.alpha == DEFAULTS.alpha and few.draft_runtime == RuntimeModel(DEFAULTS.draft_c1, DEFAULTS.draft_c2)

    telemetry = measured(count=4, verdicts=[(4, 4), (4, 2), (3, 3), (4, 0)])
    plan = plan_round(request(), telemetry, DEFAULTS)
    assert (plan.sources["alpha"], plan.sources["draft_runtime"], plan.sources["verify_runtime"]) == (
        "telemetry",
        "fitted:telemetry",
        "fitted:telemetry",
    )
    assert plan.alpha == alpha_from_verdicts(telemetry.verdicts) == 9 / 11
    assert plan.draft_runtime.c1 == pytest.approx(DRAFT_RUNTIME.c1) and plan.draft_runtime.c2 == pytest.approx(
        DRAFT_RUNTIME.c2
    )
    assert plan.verify_runtime.c1 == pytest.approx(VERIFY_RUNTIME.c1) and plan.verify_runtime.c2 == pytest.approx(
        VERIFY_RUNTIME.c2
    )
    # the plan is priced with what telemetry said, not the defaults
    fitted = costs(plan_request := request(), plan.spec_len, plan.alpha, plan.draft_runtime, plan.verify_runtime)
    assert plan.inference_s == pytest.approx(dp_batching(fitted, task_pairs(plan_request)).latency)


def test_unfit_samples_and_untested_drafts_fall_back_per_input() -> None:
    same_work = [(2, 1e9, 0.01)] * 8  # one F*b value: c1 and c2 are not determined
    shrinking = [(b, 1e9, 1.0 / b) for b in range(1, 9)]  # runtime falls with work: c1 <= 0
    for passes in (same_work, shrinking):
        plan = plan_round(request(), EdgeTelemetry(passes, measured().verify, [(0, 0)] * 8), DEFAULTS)
        assert plan.sources["draft_runtime"] == "default:unfit"
        assert plan.sources["verify_runtime"] == "fitted:telemetry"
        assert plan.sources["alpha"] == "default:no-trials" and plan.alpha == DEFAULTS.alpha


def test_eq27_shares_finish_together_and_beat_uniform() -> None:
    eq27 = plan_round(request(), None, DEFAULTS)
    uniform = plan_round(request(bandwidth="uniform"), None, DEFAULTS)
    assert sum(eq27.shares) == pytest.approx(1.0)
    assert max(eq27.upload_s) == pytest.approx(min(eq27.upload_s))  # eq. 26: everyone done together
    assert uniform.shares == pytest.approx([1 / len(TASKS)] * len(TASKS)) and uniform.sources["shares"] == "uniform"
    assert uniform.as_dict()["predicted"]["upload_s"] > 1.5 * eq27.as_dict()["predicted"]["upload_s"]
    snrs = [10 ** (snr / 10) for _, _, snr in TASKS]
    lengths = [i for i, _, _ in TASKS]
    assert list(uniform.upload_s) == pytest.approx(upload_times(lengths, snrs, uniform.shares, 1e6, 16.0 * 1280))
    # the split does not touch batching or l
    assert (eq27.batches, eq27.spec_len, eq27.inference_s) == (uniform.batches, uniform.spec_len, uniform.inference_s)


def test_snr_source_and_default() -> None:
    tasks = [{"input_tokens": 10, "output_tokens": 5}, {"input_tokens": 10, "output_tokens": 5}]
    none_given = plan_round(request(tasks=tasks), None, PlanDefaults(snr_db=10.0))
    assert none_given.sources["snr_db"] == "default"
    assert none_given.shares == pytest.approx([0.5, 0.5])
    mixed = plan_round(request(tasks=[tasks[0], {**tasks[1], "snr_db": 30.0}]), None, PlanDefaults(snr_db=10.0))
    assert mixed.sources["snr_db"] == "request+default"
    # eq. 27 with the default 10 dB for task 0: w ∝ 1 / log2(1 + snr)
    weights = [1 / math.log2(1 + 10.0), 1 / math.log2(1 + 1000.0)]
    assert mixed.shares == pytest.approx([w / sum(weights) for w in weights])


def test_dp_batching_against_max_batching() -> None:
    # The paper's (LLaMA-1.1B, LLaMA-7B) pair and Γ_s = 16 GB (Table II): room for every task in one batch,
    # so max batching puts them all together, while drafting costs enough for Algorithm 1 to pipeline.
    paper = {
        "draft_shape": {"layers": 22, "hidden": 2048, "ffn": 5632},
        "memory_budget_bytes": 16 * 10**9,
        "target_shape": {"layers": 32, "hidden": 4096, "ffn": 11008},
    }
    dp = plan_round(request(**paper, spec_len=3), None, DEFAULTS)
    most = plan_round(request(**paper, spec_len=3, batching="max"), None, DEFAULTS)
    assert (dp.sources["batching"], most.sources["batching"]) == ("algorithm1", "max-batch")
    plan_request = request(**paper)
    default_costs = costs(
        plan_request,
        3,
        DEFAULTS.alpha,
        RuntimeModel(DEFAULTS.draft_c1, DEFAULTS.draft_c2),
        RuntimeModel(DEFAULTS.verify_c1, DEFAULTS.verify_c2),
    )
    assert most.batches == max_batching(default_costs, task_pairs(plan_request)).batches
    assert dp.batches == dp_batching(default_costs, task_pairs(plan_request)).batches
    assert len(most.batches) == 1 and len(dp.batches) > 1  # Algorithm 1 splits to pipeline
    assert dp.inference_s < most.inference_s
    for plan in (dp, most):  # every task exactly once, as request indices
        assert sorted(k for batch in plan.batches for k in batch) == list(range(len(TASKS)))


def test_memory_budget_bounds_batches_and_infeasible_is_typed() -> None:
    shape = ModelShape(**DRAFT)
    one_task = shape.weight_bytes + shape.kv_bytes_per_token * (300 + 40)  # the longest task alone
    plan = plan_round(request(memory_budget_bytes=one_task, batching="max"), None, DEFAULTS)
    assert max(len(batch) for batch in plan.batches) < len(TASKS)
    for batching in ("dp", "max"):
        with pytest.raises(InfeasibleBatchingError):
            plan_round(request(memory_budget_bytes=one_task - 1, batching=batching), None, DEFAULTS)
        with pytest.raises(InfeasibleBatchingError):
            plan_round(request(memory_budget_bytes=one_task - 1, batching=batching, spec_len=2), None, DEFAULTS)


def test_chosen_length_is_the_best_and_a_fixed_one_is_kept() -> None:
    chosen = plan_round(request(), measured(), DEFAULTS)
    assert chosen.sources["spec_len"] == "eq7" and 1 <= chosen.spec_len <= DEFAULTS.l_max
    fixed = {l: plan_round(request(spec_len=l), measured(), DEFAULTS) for l in range(1, DEFAULTS.l_max + 1)}
    assert all(plan.spec_len == l and plan.sources["spec_len"] == "request" for l, plan in fixed.items())
    assert chosen.inference_s == min(plan.inference_s for plan in fixed.values())
    assert chosen.inference_s == fixed[chosen.spec_len].inference_s
    assert chosen.batches == fixed[chosen.spec_len].batches
    # the paper's FSL baseline (l = 7) is worse than the chosen l here
    assert fixed[7].inference_s > chosen.inference_s
    # l_max bounds the search
    assert plan_round(request(), measured(), PlanDefaults(min_samples=4, l_max=1)).spec_len == 1


def test_as_dict_shape() -> None:
    plan = plan_round(request(), measured(), DEFAULTS).as_dict()
    assert set(plan) == {
        "batches",
        "spec_len",
        "shares",
        "upload_s",
        "alpha",
        "draft_runtime",
        "verify_runtime",
        "predicted",
        "sources",
    }
    assert plan["predicted"]["total_s"] == pytest.approx(
        plan["predicted"]["upload_s"] + plan["predicted"]["inference_s"]
    )
    assert plan["predicted"]["upload_s"] == max(plan["upload_s"])
    assert all(isinstance(batch, list) for batch in plan["batches"])


def test_request_round_trips() -> None:
    parsed = request(bandwidth="uniform", batching="max", spec_len=5)
    assert PlanRequest.from_dict(parsed.as_dict()) == parsed
    assert (parsed.bandwidth, parsed.batching, parsed.spec_len) == ("uniform", "max", 5)
    assert request().spec_len is None and request().bandwidth == "eq27" and request().batching == "dp"


def _without(key: str) -> dict:
    out = body()
    del out[key]
    return out


def _task(**fields: object) -> dict:
    return body(tasks=[{"input_tokens": 10, "output_tokens": 10, **fields}])


BAD_REQUESTS = [
    ("not an object", []),
    ("unknown field", body(extra=1)),
    ("missing tasks", _without("tasks")),
    ("missing bits_per_token", _without("bits_per_token")),
    ("no tasks", body(tasks=[])),
    ("too many tasks", body(tasks=[{"input_tokens": 1, "output_tokens": 1}] * (MAX_TASKS + 1))),
    ("tasks not a list", body(tasks={"input_tokens": 1})),
    ("zero input", _task(input_tokens=0)),
    ("bool output", _task(output_tokens=True)),
    ("float input", _task(input_tokens=2.5)),
    ("string output", _task(output_tokens="4")),
    ("unknown task field", _task(priority=1)),
    ("nan snr", _task(snr_db=math.nan)),
    ("absurd snr", _task(snr_db=1e6)),
    ("shape missing ffn", body(draft_shape={"layers": 1, "hidden": 8})),
    ("shape zero layers", body(target_shape={"layers": 0, "hidden": 8, "ffn": 8})),
    ("shape not an object", body(draft_shape=[1, 2, 3])),
    ("negative budget", body(memory_budget_bytes=-1)),
    ("float budget", body(memory_budget_bytes=1.5e9)),
    ("zero bandwidth", body(bandwidth_hz=0)),
    ("inf bandwidth", body(bandwidth_hz=math.inf)),
    ("string bits", body(bits_per_token="16")),
    ("bad split", body(bandwidth="proportional")),
    ("bad batching", body(batching="static")),
    ("zero spec_len", body(spec_len=0)),
    ("float spec_len", body(spec_len=2.0)),
]


@pytest.mark.parametrize("name,bad", BAD_REQUESTS, ids=[name for name, _ in BAD_REQUESTS])
def test_bad_requests_are_typed(name: str, bad: object) -> None:
    with pytest.raises(PlanRequestError):
        PlanRequest.from_dict(copy.deepcopy(bad))


def test_bad_telemetry_is_typed() -> None:
    assert EdgeTelemetry.from_dict({}) == EdgeTelemetry()
    for bad in (
        [],
        {"draft": {}},
        {"draft": [[1, 2]]},
        {"verify": [[0, 1e9, 0.1]]},
        {"verify": [[1.5, 1e9, 0.1]]},
        {"draft": [[1, -1, 0.1]]},
        {"draft": [[1, 1e9, math.inf]]},
        {"verdicts": [[2, 3]]},
        {"verdicts": [[2.0, 1]]},
        {"verdicts": [["2", 1]]},
    ):
        with pytest.raises(EdgeTelemetryError):
            EdgeTelemetry.from_dict(bad)


def test_defaults_are_validated() -> None:
    for bad in ({"alpha": 1.5}, {"l_max": 0}, {"min_samples": 1}, {"draft_c1": -1.0}, {"snr_db": math.nan}):
        with pytest.raises(ValueError):
            PlanDefaults(**bad)
