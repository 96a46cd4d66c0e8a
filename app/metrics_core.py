"""Counters and histograms as plain dicts, and the Prometheus text format (0.0.4) written from their snapshots.

Why not prometheus_client's own types: one scrape of the cluster view reads every process's series, and its
collect() and generate_latest() cost ~30 and ~70 us per sample (a few thousand samples per process with the
per-adapter histograms): about 200 ms of CPU per scrape on a 2-core replica, taken from the engine. These keep a
series as a dict entry under one lock per family (~1 us per record) and write the text straight from snapshot
lists. The snapshot of a family is JSON-ready: [name, kind, doc, labelnames, series], a series being
[labelvalues, value] (counter, gauge) or [labelvalues, bucket counts (not cumulative), sum, count] (histogram).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence


class _Child:
    __slots__ = ("_family", "_key")

    def __init__(self, family: _Family, key: tuple[str, ...]):
        self._family, self._key = family, key

    def inc(self, amount: float = 1.0) -> None:
        f = self._family
        with f._lock:
            f._series[self._key] = f._series.get(self._key, 0.0) + amount

    def set(self, value: float) -> None:
        with self._family._lock:
            self._family._series[self._key] = float(value)

    def observe(self, value: float) -> None:
        f = self._family
        i = bisect.bisect_left(f.buckets, value)  # le semantics: value <= bound lands in that bucket
        with f._lock:
            s = f._series.get(self._key)
            if s is None:
                s = f._series[self._key] = [[0] * (len(f.buckets) + 1), 0.0, 0]
            s[0][i] += 1
            s[1] += value
            s[2] += 1


class _Family:
    def __init__(self, name: str, doc: str, labelnames: Sequence[str], kind: str, buckets=()):
        self.name, self.doc, self.kind = name, doc, kind
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], object] = {}
        self._children: dict[tuple[str, ...], _Child] = {}
        self._lock = threading.Lock()

    def labels(self, *values: str) -> _Child:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            key = tuple(str(v) for v in values)
            child = self._children.setdefault(key, _Child(self, key))
        return child

    def inc(self, amount: float = 1.0) -> None:  # a family without labels
        self.labels().inc(amount)

    def remove_where(self, label: str, value: str) -> None:
        """Drop every series whose `label` is `value` (a label value that lost its place in a TopK)."""
        if label not in self.labelnames:
            return
        i = self.labelnames.index(label)
        with self._lock:
            for key in [k for k in self._series if k[i] == value]:
                del self._series[key]
            for key in [k for k in self._children if k[i] == value]:
                del self._children[key]

    def snapshot(self) -> list:
        with self._lock:
            if self.kind == "histogram":
                series = [[list(k), list(s[0]), s[1], s[2]] for k, s in self._series.items()]
            else:
                series = [[list(k), v] for k, v in self._series.items()]
        return [self.name, self.kind, self.doc, list(self.labelnames), series, list(self.buckets)]


def counter(name: str, doc: str, labelnames: Sequence[str] = ()) -> _Family:
    return _Family(name, doc, labelnames, "counter")


def gauge(name: str, doc: str, labelnames: Sequence[str] = ()) -> _Family:
    return _Family(name, doc, labelnames, "gauge")


def histogram(name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]) -> _Family:
    return _Family(name, doc, labelnames, "histogram", buckets)


def family(name: str, kind: str, doc: str, labelnames: Sequence[str], series: list) -> list:
    """A snapshot family built by hand (gauges read from a kernel at collect time)."""
    return [name, kind, doc, list(labelnames), series, []]


# ---------------------------------------------------------------- the text format
def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _help(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if v != v:
        return "NaN"
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def _labels(names: Sequence[str], values: Sequence[str], extra: str) -> str:
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values))
    inner = f"{inner},{extra}" if inner and extra else inner or extra
    return "{" + inner + "}" if inner else ""


def text(snapshots: Iterable[tuple[dict[str, str], list]]) -> str:
    """The Prometheus text format for families from several processes: (process labels, families) pairs. One
    HELP/TYPE per name; each series gets its process's labels, unless it has a label of that name itself."""
    merged: dict[str, list] = {}
    for who, families in snapshots:
        for fam in families:
            name, kind, doc, labelnames, series, buckets = fam
            slot = merged.setdefault(name, [kind, doc, []])
            if slot[0] != kind:
                continue
            extra = ",".join(f'{k}="{_escape(v)}"' for k, v in who.items() if k not in labelnames)
            slot[2].append((labelnames, series, buckets, extra))
    out: list[str] = []
    for name, (kind, doc, parts) in merged.items():
        exposed = f"{name}_total" if kind == "counter" else name
        out.append(f"# HELP {exposed} {_help(doc)}")
        out.append(f"# TYPE {exposed} {kind}")
        for labelnames, series, buckets, extra in parts:
            if kind != "histogram":
                out.extend(f"{exposed}{_labels(labelnames, k, extra)} {_num(v)}" for k, v in series)
                continue
            les = [_num(b) for b in buckets] + ["+Inf"]
            for k, counts, total, count in series:
                base = _labels(labelnames, k, extra)[1:-1]
                sep = "," if base else ""
                running = 0
                for le, c in zip(les, counts):
                    running += c
                    out.append(f'{name}_bucket{{{base}{sep}le="{le}"}} {running}')
                out.append(f"{name}_sum{_labels(labelnames, k, extra)} {_num(total)}")
                out.append(f"{name}_count{_labels(labelnames, k, extra)} {count}")
    out.append("")
    return "\n".join(out)
