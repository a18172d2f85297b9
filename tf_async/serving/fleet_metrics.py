"""/metrics and /v1/lanes of the front: every replica's figures summed, each replica's own
(labelled `replica="i"`), and the router's counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from .fleet import ReplicaSet
from .policy import RoutingPolicy

Labels = tuple[tuple[str, str], ...]


class _Family:
    """One metric family across replicas: summed samples and per-replica samples."""

    def __init__(self, name: str, kind: str, doc: str):
        self.name = name
        self.kind = kind
        self.doc = doc
        self.summed: dict[tuple[str, Labels], float] = {}
        self.per_replica: list[tuple[str, Labels, float]] = []

    def add(self, replica: int, sample_name: str, labels: Labels, value: float) -> None:
        key = (sample_name, labels)
        self.summed[key] = self.summed.get(key, 0.0) + value
        self.per_replica.append((sample_name, (("replica", str(replica)),) + labels, value))

    def lines(self) -> list[str]:
        exposed = self.name + "_total" if self.kind == "counter" else self.name
        out = [f"# HELP {exposed} {_escape_help(self.doc)}", f"# TYPE {exposed} {self.kind}"]
        out += [_sample(name, labels, value) for (name, labels), value in self.summed.items()]
        out += [_sample(name, labels, value) for name, labels, value in self.per_replica]
        return out


def _families(texts: dict[int, str]) -> dict[str, _Family]:
    families: dict[str, _Family] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name,
                                         _Family(family.name, family.type, family.documentation))
            for sample in family.samples:
                if sample.name.endswith("_created"):  # a timestamp: not summable
                    continue
                merged.add(replica, sample.name, tuple(sorted(sample.labels.items())),
                           sample.value)
    return families


@dataclass(slots=True, frozen=True)
class RouterCounts:
    """The router's own figures, per replica and in all (a snapshot for /metrics)."""

    policy: RoutingPolicy
    num_routed: tuple[int, ...]
    num_restarts: tuple[int, ...]
    num_lost: tuple[int, ...]
    num_no_replica: int

    @staticmethod
    def of(replicas: ReplicaSet) -> RouterCounts:
        return RouterCounts(replicas.policy, tuple(replicas.num_routed),
                            tuple(r.num_failures for r in replicas.replicas),
                            tuple(replicas.num_lost_streams), replicas.num_no_replica)


def _router_lines(counts: RouterCounts) -> list[str]:
    policy = counts.policy
    per_replica = [
        ("tf_router_requests_total", "counter", "Requests the front routed to each replica.",
         counts.num_routed),
        ("tf_router_replica_up", "gauge", "1 while the replica is in routing.",
         tuple(int(r.up) for r in policy.replicas)),
        ("tf_router_in_flight", "gauge", "Requests the front has in flight at each replica.",
         tuple(r.in_flight for r in policy.replicas)),
        ("tf_router_replica_restarts_total", "counter", "Replica process exits not asked for.",
         counts.num_restarts),
        ("tf_router_lost_requests_total", "counter",
         "Requests ended with an error because their replica failed.", counts.num_lost),
    ]
    lines: list[str] = []
    for name, kind, doc, values in per_replica:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [_sample(name, (("replica", str(i)),), float(v)) for i, v in enumerate(values)]
    for name, doc, value in (
            ("tf_router_affinity_hits_total", "Requests routed to their conversation's replica.",
             policy.num_affinity_hits),
            ("tf_router_affinity_overrides_total",
             "Requests whose conversation's replica was down or too busy.",
             policy.num_affinity_overrides),
            ("tf_router_no_replica_total", "Requests refused: no replica ready (503).",
             counts.num_no_replica)):
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter", _sample(name, (), float(value))]
    return lines


def render_metrics(texts: dict[int, str], counts: RouterCounts) -> str:
    """Prometheus text: each replica's families summed and labelled, then the router's."""
    lines: list[str] = []
    for family in _families(texts).values():
        lines += family.lines()
    return "\n".join(lines + _router_lines(counts)) + "\n"


def _sample(name: str, labels: Labels, value: float) -> str:
    if not labels:
        return f"{name} {_number(value)}"
    inner = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
    return f"{name}{{{inner}}} {_number(value)}"


def _number(value: float) -> str:
    return floatToGoString(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def router_view(policy: RoutingPolicy, index: int) -> dict[str, int | bool]:
    """What the routing policy knows of replica `index` (its live count, its last poll)."""
    state = policy.replicas[index]
    return {"up": state.up, "in_flight": state.in_flight, "queued": state.queued,
            "lanes_free": state.lanes_free}


def merge_lanes(answers: dict[int, Any]) -> dict[str, Any]:
    """Replicas' /v1/lanes answers as one: lanes in one list (with `replica`), stats summed."""
    lanes: list[dict[str, Any]] = []
    stats: dict[str, int | float] = {}
    for index, answer in sorted(answers.items()):
        lanes += [{**lane, "replica": index} for lane in answer.get("data", [])]
        for key, value in answer.get("stats", {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                stats[key] = stats.get(key, 0) + value
    return {"object": "list", "data": lanes, "stats": stats}


def sum_lanes(answers: dict[int, Any], replicas: ReplicaSet) -> dict[str, Any]:
    """merge_lanes, and per replica: its url, pid, restarts, lanes and the router's view."""
    per_replica = [{"replica": r.index, "url": r.url, "pid": r.pid, "restarts": r.num_failures,
                    "router": router_view(replicas.policy, r.index), "up": r.index in answers,
                    "data": answers.get(r.index, {}).get("data", []),
                    "stats": answers.get(r.index, {}).get("stats", {})}
                   for r in replicas.replicas]
    return merge_lanes(answers) | {"replicas": per_replica}
