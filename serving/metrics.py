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
    MetricSpec("interrupted_steps", "lookahead_interrupted_steps_total", "counter",
               "Prefill steps stopped between layers: every request in them was cancelled"),
    MetricSpec("steps", "lookahead_engine_steps_total", "counter", "Engine steps run"),
    MetricSpec("step_seconds", "lookahead_engine_step_seconds_total", "counter",
               "Wall seconds spent inside engine steps (the model, sampling and the outputs)"),
    MetricSpec("decode_steps", "lookahead_decode_steps_total", "counter",
               "Engine steps with decode rows only (no prompt chunk)"),
    MetricSpec("decode_step_seconds", "lookahead_decode_step_seconds_total", "counter",
               "Wall seconds of the decode-only steps: over lookahead_decode_steps_total, what one "
               "token of every running request costs the engine"),
    # the prefix cache (runtime/prefix_cache.py): full KV blocks that outlive their request
    MetricSpec("prefix_cache_hit_rate", "lookahead_prefix_cache_hit_rate", "gauge",
               "Share of looked-up prompt tokens whose KV came from the prefix cache (NaN before any request)"),
    MetricSpec("cached_blocks", "lookahead_prefix_cache_blocks", "gauge",
               "KV blocks the prefix cache holds, in use or reclaimable"),
    MetricSpec("cached_free_blocks", "lookahead_prefix_cache_reclaimable_blocks", "gauge",
               "Cached KV blocks no request uses: kept until the pool needs the room (LRU)"),
    MetricSpec("prefix_cache_queries", "lookahead_prefix_cache_query_tokens_total", "counter",
               "Prompt tokens looked up in the prefix cache"),
    MetricSpec("prefix_cache_hits", "lookahead_prefix_cache_hit_tokens_total", "counter",
               "Prompt tokens served from the prefix cache (not prefilled again): the requests' cached tokens"),
    MetricSpec("prefix_cache_evictions", "lookahead_prefix_cache_evicted_blocks_total", "counter",
               "Cached KV blocks evicted to make room"),
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


def prometheus_text(stats: Mapping[str, Any], labels: Mapping[str, str], specs=METRICS) -> str:
    """The same families in Prometheus' text format, for a server that takes exposition text (the
    Dynamo worker's /metrics): counters are the cumulative values themselves, a missing gauge
    (None, e.g. the hit rate before any request) is NaN, a missing counter is left out."""
    label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    lines = []
    for spec in specs:
        value = stats.get(spec.stat)
        if value is None and spec.kind == "counter":
            continue
        lines.append(f"# HELP {spec.name} {spec.description}")
        lines.append(f"# TYPE {spec.name} {spec.kind}")
        number = float("nan") if value is None else float(value)
        lines.append(f"{spec.name}{{{label_text}}} {_number(number)}")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if not value.is_integer() else str(int(value))
