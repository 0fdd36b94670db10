"""A ray replica's stage series carried to the API process (stages/remote_series.py), without Ray: what one
registry records arrives in another exactly (counters, histogram buckets and sums, gauges summed over replicas)."""

from prometheus_client import generate_latest

from stages.metrics import Metrics
from stages.remote_series import SeriesDiff, SeriesSink


def _lines(metrics: Metrics, prefix: str) -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return sorted(line for line in text.splitlines() if line.startswith(prefix) and "_created" not in line)


def test_counters_and_histograms_arrive_exactly_once():
    actor, api, alone = Metrics(), Metrics(), Metrics()
    diff, sink = SeriesDiff(actor.registry), SeriesSink(api.registry)
    for metrics in (actor, alone):  # `alone` records what the API process would have had on the local backend
        metrics.llm.tokens.labels(model="m").inc(5)
        for seconds in (0.003, 0.2, 7.0):
            metrics.llm.ttft.labels(model="m").observe(seconds)
    sink.apply(0, diff.changes())
    assert diff.changes() == []  # nothing changed since
    for metrics in (actor, alone):
        metrics.llm.tokens.labels(model="m").inc(3)
        metrics.llm.ttft.labels(model="m").observe(0.05)
    sink.apply(0, diff.changes())
    assert _lines(api, "mmserve_llm_") == _lines(alone, "mmserve_llm_")
    assert api.registry.get_sample_value("mmserve_llm_generated_tokens_total", {"model": "m"}) == 8
    assert api.registry.get_sample_value("mmserve_llm_time_to_first_token_seconds_count", {"model": "m"}) == 4


def test_gauges_sum_over_replicas_and_a_lost_one_drops_out():
    replicas = [Metrics(), Metrics()]
    diffs = [SeriesDiff(m.registry) for m in replicas]
    api = Metrics()
    sink = SeriesSink(api.registry)
    for r, used in enumerate((3, 4)):
        replicas[r].llm.blocks.labels(model="m", state="used").set(used)
        sink.apply(r, diffs[r].changes())
    used = lambda: api.registry.get_sample_value("mmserve_llm_kv_blocks", {"model": "m", "state": "used"})  # noqa: E731
    assert used() == 7
    sink.drop(1)
    assert used() == 3


def test_the_pools_own_series_stay_behind():
    actor, api = Metrics(), Metrics()
    actor.stage.run_time.labels(stage="m/llm", model="m").observe(0.1)  # the API process's pool records its own
    SeriesSink(api.registry).apply(0, SeriesDiff(actor.registry).changes())
    assert api.registry.get_sample_value("mmserve_stage_run_seconds_count", {"stage": "m/llm", "model": "m"}) is None
