"""Engine stats -> Prometheus metric families on Triton's metrics endpoint (:8002/metrics).

`MetricExporter` takes a family factory, so the Triton model passes `pb_utils.MetricFamily` and the
tests pass a fake. Counters are cumulative in `Engine.stats()`; the exporter increments each family
by the difference since the last update, as Prometheus counters must only go up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class MetricSpec:
    stat: str            # key in Engine.stats() (plus tokens_per_s, total_blocks, num_tokenizing: the loop's)
    name: str            # Prometheus family name
    kind: str            # "gauge" or "counter"
    description: str


METRICS = (
    MetricSpec("num_waiting", "lookahead_queue_depth", "gauge",
               "Requests waiting for admission (KV blocks or a batch slot)"),
    MetricSpec("num_running", "lookahead_running_requests", "gauge", "Requests in the decode batch"),
    MetricSpec("free_blocks", "lookahead_free_kv_blocks", "gauge", "Free blocks in the host KV pool"),
    MetricSpec("total_blocks", "lookahead_kv_blocks", "gauge", "Blocks in the host KV pool, free or not"),
    MetricSpec("num_tokenizing", "lookahead_tokenizing_requests", "gauge",
               "Requests whose long prompt is being tokenized off the request thread"),
    MetricSpec("tokens_per_s", "lookahead_output_tokens_per_second", "gauge",
               "Generated tokens per second over the last few seconds"),
    MetricSpec("prefetch_hit_rate", "lookahead_prefetch_hit_rate", "gauge",
               "Share of needed KV blocks already resident on the device (lookahead mode)"),
    MetricSpec("device_resident_bytes", "lookahead_device_resident_bytes", "gauge",
               "KV bytes resident in device memory (lookahead mode)"),
    MetricSpec("device_bytes_per_seq", "lookahead_device_working_set_bytes_per_sequence", "gauge",
               "One sequence's KV working set in the device tier, whatever its context (lookahead mode)"),
    MetricSpec("device_summary_bytes_per_seq", "lookahead_device_summary_bytes_per_sequence", "gauge",
               "One sequence's per-block key summaries in the device tier, sized for max_model_len "
               "(lookahead mode)"),
    MetricSpec("draft_accept_rate", "lookahead_draft_accept_rate", "gauge",
               "Share of steps whose draft token equalled the real one (lookahead mode)"),
    MetricSpec("agreement_mean", "lookahead_topk_agreement", "gauge",
               "Mean overlap of the draft-predicted and the true top-K block sets (lookahead mode)"),
    MetricSpec("h2d_bytes", "lookahead_h2d_bytes_total", "counter", "KV bytes copied host to device"),
    MetricSpec("urgent_blocks", "lookahead_urgent_blocks_total", "counter",
               "KV blocks fetched on the urgent path after a prefetch miss"),
    MetricSpec("prefetched_blocks", "lookahead_prefetched_blocks_total", "counter",
               "KV blocks copied host to device ahead of need, as the draft predicted (lookahead mode)"),
    MetricSpec("drafts_proposed", "lookahead_drafts_proposed_total", "counter",
               "Draft tokens proposed; the draft accept rate is over these (lookahead mode)"),
    MetricSpec("transfer_wait_s", "lookahead_transfer_wait_seconds_total", "counter",
               "Seconds the compute stream waited for KV transfers"),
    MetricSpec("output_tokens", "lookahead_output_tokens_total", "counter", "Generated tokens"),
    MetricSpec("prompt_tokens", "lookahead_prompt_tokens_total", "counter", "Prefilled prompt tokens"),
    MetricSpec("finished_requests", "lookahead_finished_requests_total", "counter",
               "Requests that ran to a stop condition"),
    MetricSpec("aborted_requests", "lookahead_aborted_requests_total", "counter",
               "Requests cancelled by their client (their KV blocks were freed)"),
    MetricSpec("steps", "lookahead_engine_steps_total", "counter", "Engine steps run"),
)

FamilyFactory = Callable[[str, str, str], Any]     # (name, description, kind) -> family with .Metric(labels=)


class MetricExporter:
    def __init__(self, make_family: FamilyFactory, labels: Mapping[str, str], specs=METRICS):
        # Triton refuses updates to a metric whose family object was garbage-collected: keep both.
        self._families = [make_family(s.name, s.description, s.kind) for s in specs]
        self._metrics = [(s, f.Metric(labels=dict(labels))) for s, f in zip(specs, self._families)]
        self._last: dict[str, float] = {}

    def close(self) -> None:
        """Drop the metrics before their families (the order Triton requires)."""
        self._metrics.clear()
        self._families.clear()

    def update(self, stats: Mapping[str, Any]) -> None:
        for spec, metric in self._metrics:
            value = stats.get(spec.stat)
            if spec.kind == "gauge":
                # None (e.g. the hit rate in dense mode, which prefetches nothing) shows as NaN, not 0.
                metric.set(float("nan") if value is None else float(value))
            elif value is not None:
                value = float(value)
                delta = value - self._last.get(spec.stat, 0.0)
                if delta > 0:
                    metric.increment(delta)
                self._last[spec.stat] = value
