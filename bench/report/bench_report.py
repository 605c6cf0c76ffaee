#!/usr/bin/env python3
"""Benchmark report: the recorded results in bench/results -> a markdown report
with SVG figures.

    python3 bench/report/bench_report.py --results bench/results --out bench/results/report

writes <out>/report.md and <out>/figures/*.svg. Standard library only: the CI
machine is a bare Debian 12 with python3.

Every figure states the command, GPU and date of the runs it plots. Each of
the three is taken from a field of the JSON where the bench writes one, else
from <results>/provenance.json (bench/report/run_suite.sh writes it for the
files it produces), else from KNOWN_SOURCES below, which copies what the
hand-written summaries next to the JSON (*.md) say about the recorded runs.

Exit status: 0 when the report was written; 2 when an input that a figure
needs is malformed (the message names the file and the key). A missing input
only leaves its figure (or its part of a figure) out, with a line in the report.
"""

import argparse
import datetime
import glob
import html
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

# --------------------------------------------------------------------------
# Reading inputs


class InputError(Exception):
    """An input that a figure needs is malformed; the message names the file and the key."""

    def __init__(self, path, key, problem):
        where = f"{path}: key '{key}'" if key else path
        super().__init__(f"{where}: {problem}")


class MissingInput(Exception):
    """The required inputs of a figure are absent: the figure is left out."""

    def __init__(self, *names):
        super().__init__(", ".join(names))
        self.names = names

    def sentence(self):
        return " and ".join(f"`{n}`" for n in self.names) + (" is" if len(self.names) == 1 else " are") + " missing"


def _kind(value):
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


class Node:
    """A value read from an input file that remembers where it came from, so that
    every complaint names the file and the key path, e.g. runs[3].images_per_s."""

    def __init__(self, value, file, path=""):
        self.value, self.file, self.path = value, file, path

    def _sub(self, key):
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def error(self, problem, key=None):
        return InputError(self.file, self._sub(key) if key is not None else (self.path or "(top level)"), problem)

    def is_list(self):
        return isinstance(self.value, list)

    def has(self, key):
        return isinstance(self.value, dict) and key in self.value

    def __getitem__(self, key):
        if not isinstance(self.value, dict):
            raise self.error(f"expected an object holding '{key}', got {_kind(self.value)}")
        if key not in self.value:
            raise self.error("missing", key)
        return Node(self.value[key], self.file, self._sub(key))

    def get(self, key):
        return self[key] if self.has(key) else None

    def elems(self, key=None, nonempty=True):
        node = self if key is None else self[key]
        if not isinstance(node.value, list):
            raise node.error(f"expected a list, got {_kind(node.value)}")
        if nonempty and not node.value:
            raise node.error("expected a non-empty list")
        return [Node(v, node.file, node._sub(i)) for i, v in enumerate(node.value)]

    def num(self, key=None):
        node = self if key is None else self[key]
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise node.error(f"expected a finite number, got {v!r}")
        return float(v)

    def whole(self, key=None):
        node = self if key is None else self[key]
        v = node.num()
        if v != int(v):
            raise node.error(f"expected an integer, got {node.value!r}")
        return int(v)

    def text(self, key=None):
        node = self if key is None else self[key]
        if not isinstance(node.value, str):
            raise node.error(f"expected a string, got {node.value!r}")
        return node.value


class Results:
    """The results folder: loads inputs on demand and remembers which were used."""

    def __init__(self, folder):
        self.folder = folder
        self.used = set()
        self._provenance = None

    def path(self, name):
        return os.path.join(self.folder, name)

    def exists(self, name):
        return os.path.isfile(self.path(name))

    def json(self, name, required=True):
        if not self.exists(name):
            if required:
                raise MissingInput(name)
            return None
        self.used.add(name)
        try:
            with open(self.path(name), encoding="utf-8") as f:
                return Node(json.load(f), self.path(name))
        except json.JSONDecodeError as e:
            raise InputError(self.path(name), None, f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")
        except UnicodeDecodeError as e:
            raise InputError(self.path(name), None, f"not UTF-8 text: {e}")

    def jsonl(self, name, required=True):
        """JSON lines: a list of Nodes whose path is the line number."""
        if not self.exists(name):
            if required:
                raise MissingInput(name)
            return None
        self.used.add(name)
        records = []
        try:
            with open(self.path(name), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            records.append(Node(json.loads(line), self.path(name), f"line {number}"))
                        except json.JSONDecodeError as e:
                            raise InputError(self.path(name), f"line {number}", f"not valid JSON: {e.msg}")
        except UnicodeDecodeError as e:
            raise InputError(self.path(name), None, f"not UTF-8 text: {e}")
        if not records:
            raise InputError(self.path(name), None, "no records")
        return records

    def provenance(self, name):
        """run_suite.sh's record of command/GPU/date for a file it produced."""
        if self._provenance is None:
            doc = self.json("provenance.json", required=False)
            self._provenance = {}
            if doc is not None:
                if not isinstance(doc.value, dict):
                    raise doc.error("expected an object keyed by file name")
                for key in doc.value:
                    entry = doc[key]
                    self._provenance[key] = {k: entry.text(k) for k in ("command", "gpu", "date") if entry.has(k)}
        return self._provenance.get(name, {})


# --------------------------------------------------------------------------
# Where each run came from: command, GPU, date

# What the hand-written summaries say about the recorded runs whose JSON does
# not carry it. Used only for the fields the JSON and provenance.json lack.
_CPU_BENCH_MD = dict(doc="cpu-bench.md", gpu="none: CPU ranks on the 2-core CI VM (Debian 12, Xeon with AVX-512)",
                     date="2026-12-02 17:10 UTC")
KNOWN_SOURCES = {
    **{f"cpu-engine-step-np{n}.json": dict(
        _CPU_BENCH_MD,
        command=f"mpirun -np {n} build/cpu/bench/mpi/bench_engine_step --params 32 --iterations 3 "
                f"--json bench/results/cpu-engine-step-np{n}.json") for n in (1, 2, 4)},
    "cpu-optimizer.json": dict(
        _CPU_BENCH_MD, gpu="none: CPU bench on the 2-core CI VM (Debian 12, Xeon with AVX-512)",
        command="build/cpu/bench/cpu/bench_cpu_optimizer --benchmark_min_time=0.5 "
                "--benchmark_out=bench/results/cpu-optimizer.json --benchmark_out_format=json"),
    "cpu-adamw-vs-torch-h200host.json": dict(
        doc="offload.md", gpu="none: CPU bench, 16 threads, on the host VM of the H200 machine",
        command="/root/zero-offload-build/bench/cpu/bench_cpu_adamw_vs_torch with JSON output "
                "(the other flags are not recorded)"),
    "gpu-optimizer.json": dict(
        doc="gpu-kernels.md",
        command="bash bench/gpu/run_device.sh -> build/dev/bench/gpu/gpu_bench_optimizer --json gpu-optimizer.json"),
    "gpu-collectives-nccl-np1.json": dict(
        doc="gpu-kernels.md", date="2026-12-02 16:12 UTC",
        command="bash bench/gpu/run_device.sh -> build/dev/bench/gpu/gpu_bench_collectives "
                "--json gpu-collectives-nccl-np1.json"),
    "gpu-collectives-staged-np1.json": dict(
        doc="gpu-kernels.md", date="2026-12-02 16:12 UTC",
        command="bash bench/gpu/run_device.sh -> build/dev/bench/gpu/gpu_bench_collectives --staged "
                "--max-bytes 256M --json gpu-collectives-staged-np1.json"),
    "offload/summary.json": dict(
        doc="offload.md", gpu="NVIDIA H200 (host: 16-core Intel Xeon VM)", date="2026-12-03 08:08-08:35 UTC",
        command="bash bench/gpu/run_offload_device.sh (phases in offload.md)"),
    "sdxl-unet-fwdbwd.jsonl": dict(
        doc="sdxl-gpu.md", gpu="NVIDIA H200 (driver 580.159.04), CUDA 13.0, LibTorch 2.11.0+cu130",
        date="2026-12-02 16:48-16:55 UTC",
        command="bash bench/gpu/run_sdxl_device.sh -> unet_bench --device cuda --dtype bf16 --batch B --backward "
                "[--checkpointing] --steps 5 --warmup 2"),
}
NOT_RECORDED = "not recorded"


@dataclass
class Source:
    file: str
    command: str
    gpu: str
    date: str
    origin: str  # where command/GPU/date were read, for the reader to check


def nice_date(text):
    """ISO times ("2026-12-02T19:00:44+00:00", "...Z") -> "2026-12-02 19:00 UTC"; other text as is."""
    if "T" not in text and ":" not in text:
        return text  # a plain date: no time to add
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text
    if when.tzinfo is not None:
        when = when.astimezone(datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M UTC")


def source_for(res, name, **from_json):
    """Command/GPU/date of one input: JSON fields first (passed in by the
    caller), then provenance.json, then KNOWN_SOURCES."""
    recorded, known = res.provenance(name), KNOWN_SOURCES.get(name, {})
    values, origins = {}, {}  # origin -> the fields read there
    for key, label in (("command", "command"), ("gpu", "GPU"), ("date", "date")):
        if from_json.get(key):
            values[key], origin = from_json[key], "the JSON"
        elif recorded.get(key):
            values[key], origin = recorded[key], "provenance.json"
        elif known.get(key):
            values[key], origin = known[key], known["doc"]
        else:
            values[key], origin = NOT_RECORDED, "nowhere"
        origins.setdefault(origin, []).append(label)
    values["date"] = nice_date(values["date"])
    origin = "; ".join(f"{', '.join(labels)}: {where}" for where, labels in origins.items())
    return Source(name, values["command"], values["gpu"], values["date"], origin)


def gbench_source(res, name, doc):
    """Google Benchmark JSON: the date is in its "context" block; the host too."""
    context = doc.get("context")
    date = context.text("date") if context is not None and context.has("date") else None
    return source_for(res, name, date=date)


def gbench_host(doc):
    context = doc.get("context")
    if context is None:
        return ""
    parts = []
    if context.has("host_name"):
        parts.append(f"host '{context.text('host_name')}'")
    if context.has("num_cpus"):
        parts.append(f"{context.whole('num_cpus')} CPUs")
    if context.has("mhz_per_cpu"):
        parts.append(f"{context.whole('mhz_per_cpu')} MHz")
    return ", ".join(parts)


# --------------------------------------------------------------------------
# A tiny SVG helper: axes, ticks, labels, legend, grouped (stacked) bars, lines

PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#999999", "#000000", "#F0E442"]
WIDTH = 960
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"


def text_width(text, size):
    return 0.58 * size * len(text)  # close enough for a sans-serif font


def wrap(text, max_chars):
    """Word-wrap to lines of at most max_chars (a longer word gets a line of its own)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > max_chars:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line] if line else lines


class Svg:
    def __init__(self, width, height):
        self.width, self.height, self.parts = width, height, []

    def line(self, x1, y1, x2, y2, stroke="#000", width=1.0, dash=None):
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
                          f'stroke-width="{width}"{extra}/>')

    def rect(self, x, y, w, h, fill, stroke=None, dash=None, opacity=1.0, tip=None):
        extra = f' stroke="{stroke}" stroke-width="1"' if stroke else ""
        extra += f' stroke-dasharray="{dash}"' if dash else ""
        extra += f' fill-opacity="{opacity}"' if opacity != 1.0 else ""
        body = f"<title>{html.escape(tip)}</title>" if tip else ""
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" '
                          f'fill="{fill}"{extra}>{body}</rect>')

    def text(self, x, y, text, size=12, anchor="start", weight=None, rotate=None, fill="#000"):
        extra = f' font-weight="{weight}"' if weight else ""
        extra += f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate else ""
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                          f'fill="{fill}"{extra}>{html.escape(text)}</text>')

    def polyline(self, points, stroke, width=2.0, dash=None):
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        self.parts.append(f'<polyline points="{coords}" fill="none" stroke="{stroke}" stroke-width="{width}"{extra}/>')

    def marker(self, x, y, shape, fill, tip=None):
        """circle, square or triangle: tells apart lines that lie on each other"""
        body = f"<title>{html.escape(tip)}</title>" if tip else ""
        if shape == "square":
            self.parts.append(f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="{fill}">{body}</rect>')
        elif shape == "triangle":
            self.parts.append(f'<polygon points="{x:.1f},{y - 4:.1f} {x - 4:.1f},{y + 3:.1f} {x + 4:.1f},{y + 3:.1f}" '
                              f'fill="none" stroke="{fill}" stroke-width="1.2">{body}</polygon>')
        else:
            self.parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{fill}">{body}</circle>')

    def render(self, title):
        return (f'<?xml version="1.0" encoding="UTF-8"?>\n'
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height:.0f}" '
                f'viewBox="0 0 {self.width} {self.height:.0f}" font-family="{FONT}">\n'
                f"<title>{html.escape(title)}</title>\n"
                f'<rect x="0" y="0" width="{self.width}" height="{self.height:.0f}" fill="#fff"/>\n'
                + "\n".join(self.parts) + "\n</svg>\n")


def nice_step(span, target_ticks):
    raw = span / max(target_ticks, 1)
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * power >= raw:
            return m * power
    return 10 * power


class Axis:
    """Data value -> pixel, linear or logarithmic, with tick values."""

    def __init__(self, lo, hi, p0, p1, log=False, base=10, ticks=6):
        self.log, self.base, self.p0, self.p1 = log, base, p0, p1
        if log:
            self.e0 = math.floor(math.log(lo, base) + 1e-9)
            self.e1 = math.ceil(math.log(hi, base) - 1e-9)
            if self.e1 == self.e0:
                self.e1 += 1
            stride = max(1, math.ceil((self.e1 - self.e0) / 10))  # at most ~10 labelled decades
            self.tick_values = [base ** e for e in range(self.e0, self.e1 + 1, stride)]
            self.lo, self.hi = float(base ** self.e0), float(base ** self.e1)
        else:
            step = nice_step(hi - lo or 1.0, ticks)
            self.lo = math.floor(lo / step) * step
            self.hi = math.ceil(hi / step - 1e-9) * step
            if self.hi <= self.lo:
                self.hi = self.lo + step
            count = int(round((self.hi - self.lo) / step))
            self.tick_values = [self.lo + i * step for i in range(count + 1)]

    def __call__(self, v):
        if self.log:
            f = (math.log(v, self.base) - self.e0) / (self.e1 - self.e0)
        else:
            f = (v - self.lo) / (self.hi - self.lo)
        return self.p0 + f * (self.p1 - self.p0)


def fmt_number(v):
    """Tick labels: 0.5, 12, 1.5k, 2M, 1e-05..."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def fmt_bytes(v):
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if v >= scale:
            return f"{v / scale:g} {unit}"
    return f"{v:g} B"


@dataclass
class Frame:
    """The common part of both charts: title, plot area, legend, footer."""
    title: str
    footer: list  # source lines: file, command, GPU, date
    legend: list  # (label, colour, style[, marker]) with style "box", "faint", "line", "dash"
    plot_height: int = 330
    left: int = 90
    right: int = 40
    x_label_rows: int = 1  # lines of x tick labels below the axis
    x_title: str = ""
    width: int = WIDTH

    def layout(self):
        """Places the legend and footer under the plot; returns the total height."""
        self.top = 46
        self.bottom = self.top + self.plot_height
        y = self.bottom + 16 * self.x_label_rows + 12 + (20 if self.x_title else 0)
        self.legend_rows, row, x = [], [], self.left
        for item in self.legend:
            w = 30 + text_width(item[0], 12) + 18
            if row and x + w > self.width - self.right:
                self.legend_rows.append(row)
                row, x = [], self.left
            row.append((x, item))
            x += w
        if row:
            self.legend_rows.append(row)
        self.legend_top = y + 8
        y = self.legend_top + 20 * len(self.legend_rows) + 8
        self.footer_lines = [line for text in self.footer for line in wrap(text, int((self.width - 30) / (0.58 * 10.5)))]
        self.footer_top = y + 6
        return self.footer_top + 14 * len(self.footer_lines) + 10

    def draw(self, svg):
        svg.text(self.width / 2, 26, self.title, size=16, anchor="middle", weight="bold")
        for r, row in enumerate(self.legend_rows):
            y = self.legend_top + 20 * r
            for x, (label, colour, style, *marker) in row:
                if style == "line":
                    svg.line(x, y + 7, x + 22, y + 7, stroke=colour, width=2.5)
                elif style == "dash":
                    svg.line(x, y + 7, x + 22, y + 7, stroke=colour, width=1.5, dash="6 4")
                elif style == "faint":
                    svg.rect(x + 4, y, 14, 14, colour, stroke="#333", dash="3 2", opacity=0.3)
                else:
                    svg.rect(x + 4, y, 14, 14, colour)
                if marker:
                    svg.marker(x + 11, y + 7, marker[0], colour)
                svg.text(x + 28, y + 12, label, size=12)
        if self.footer_lines:
            svg.line(15, self.footer_top - 6, self.width - 15, self.footer_top - 6, stroke="#ccc")
        for i, line in enumerate(self.footer_lines):
            svg.text(15, self.footer_top + 8 + 14 * i, line, size=10.5, fill="#444")

    def y_axis(self, svg, axis, label, fmt, right=False):
        x = self.width - self.right if right else self.left
        svg.line(x, self.top, x, self.bottom)
        for v in axis.tick_values:
            y = axis(v)
            if not right:
                svg.line(self.left, y, self.width - self.right, y, stroke="#e5e5e5")
            svg.line(x, y, x + (5 if right else -5), y)
            svg.text(x + (8 if right else -8), y + 4, fmt(v), size=11, anchor="start" if right else "end")
        mid = (self.top + self.bottom) / 2
        svg.text(x + (62 if right else -66), mid, label, size=12, anchor="middle", rotate=90 if right else -90)


@dataclass
class Bar:
    segments: list  # stacked from the bottom: (colour key, value)
    faint: bool = False  # drawn light with a dashed outline (e.g. a prediction)
    label: str = ""  # printed above the bar
    tip: str = ""


def bar_chart(title, groups, y_title, footer, colour_keys, *, clusters=None, y2=None, ref_lines=(),
              faint_legend=None, x_title="", colours=None):
    """Grouped bars, each optionally stacked.
    groups: [(x label, [Bar, ...])]; colour_keys: legend order of the segment keys;
    clusters: [(label, number of groups)] drawn as a second row of x labels;
    y2: (title, factor, tick formatter) for a right axis showing y x factor;
    ref_lines: [(label, value)] horizontal dashed lines (ceilings); colours: fixed
    colours of some keys (the rest take the palette in order)."""
    palette = [c for c in PALETTE if c not in (colours or {}).values()]
    free = [key for key in colour_keys if key not in (colours or {})]
    colours = {**{key: palette[i % len(palette)] for i, key in enumerate(free)}, **(colours or {})}
    legend = [(key, colours[key], "box") for key in colour_keys]
    if faint_legend:
        legend.append((faint_legend, "#888", "faint"))
    legend += [(label, "#333", "dash") for label, _ in ref_lines]
    # Wider than the default when the groups need it: every word of an x label fits its group.
    right = 110 if y2 else 40
    longest_word = max(text_width(word, 11) for label, _ in groups for word in label.split())
    group_width = max((WIDTH - 90 - right) / max(len(groups), 1), longest_word + 12)
    width = int(90 + right + group_width * len(groups))
    label_chars = max(6, int(group_width / (0.58 * 11)))
    label_lines = [wrap(label, label_chars) for label, _ in groups]
    cluster_lines = [wrap(label, max(8, int(count * group_width / (0.58 * 12)))) for label, count in clusters or []]
    frame = Frame(title, footer, legend, right=right, x_title=x_title, width=width,
                  x_label_rows=max(len(lines) for lines in label_lines) + max(map(len, cluster_lines), default=0))
    svg = Svg(width, frame.layout())
    frame.draw(svg)
    top_value = max([sum(v for _, v in bar.segments) for _, bars in groups for bar in bars] +
                    [v for _, v in ref_lines] + [1e-30])
    y = Axis(0, top_value * 1.08, frame.bottom, frame.top)
    frame.y_axis(svg, y, y_title, fmt_number)
    if y2:
        title2, factor, fmt2 = y2
        y2_axis = Axis(0, y.hi * factor, frame.bottom, frame.top)
        y2_axis.tick_values = [v for v in y2_axis.tick_values if v <= y.hi * factor * 1.0001]
        y2_axis.lo, y2_axis.hi = 0, y.hi * factor  # the left axis's scale, in the right axis's unit
        frame.y_axis(svg, y2_axis, title2, fmt2, right=True)
    most_bars = max(len(bars) for _, bars in groups)
    bar_width = min(46, group_width * 0.8 / max(most_bars, 1))
    for g, (label, bars) in enumerate(groups):
        x0 = frame.left + g * group_width
        start = x0 + (group_width - bar_width * len(bars)) / 2
        for b, bar in enumerate(bars):
            x, base = start + b * bar_width, 0.0
            for key, value in bar.segments:
                svg.rect(x + 1, y(base + value), bar_width - 2, y(base) - y(base + value), colours[key],
                         stroke="#333" if bar.faint else None, dash="3 2" if bar.faint else None,
                         opacity=0.3 if bar.faint else 1.0, tip=f"{bar.tip or key}: {value:g}")
                base += value
            if bar.label:
                svg.text(x + bar_width / 2, y(base) - 4, bar.label, size=10, anchor="middle")
        for i, line in enumerate(label_lines[g]):
            svg.text(x0 + group_width / 2, frame.bottom + 15 + 14 * i, line, size=11, anchor="middle")
    if clusters:
        g = 0
        cluster_y = frame.bottom + 16 * max(len(lines) for lines in label_lines) + 14
        for (label, count), lines in zip(clusters, cluster_lines):
            x0, x1 = frame.left + g * group_width, frame.left + (g + count) * group_width
            svg.line(x0 + 4, cluster_y - 11, x1 - 4, cluster_y - 11, stroke="#888")
            for i, line in enumerate(lines):
                svg.text((x0 + x1) / 2, cluster_y + 4 + 15 * i, line, size=12, anchor="middle", weight="bold")
            if g:
                svg.line(x0, frame.top, x0, frame.bottom, stroke="#bbb", dash="2 3")
            g += count
    for label, value in ref_lines:
        svg.line(frame.left, y(value), width - frame.right, y(value), stroke="#333", width=1.5, dash="6 4")
        svg.text(width - frame.right - 4, y(value) - 5, label, size=11, anchor="end")
    svg.line(frame.left, frame.bottom, width - frame.right, frame.bottom)
    if x_title:
        svg.text((frame.left + width - frame.right) / 2, frame.bottom + 16 * frame.x_label_rows + 22, x_title,
                 size=12, anchor="middle")
    return svg.render(title)


@dataclass
class Line:
    label: str
    points: list  # [(x, y)], > 0 on a log axis
    colour: int = 0  # index into PALETTE
    dashed: bool = False
    marker: str = "circle"  # circle, square, triangle


def line_chart(title, series, x_title, y_title, footer, *, x_fmt=fmt_number, y_fmt=fmt_number, log_x=False,
               log_y=False, x_base=10):
    """series: [Line]."""
    legend = [(s.label, PALETTE[s.colour % len(PALETTE)], "dash" if s.dashed else "line", s.marker) for s in series]
    frame = Frame(title, footer, legend, x_title=x_title)
    svg = Svg(WIDTH, frame.layout())
    frame.draw(svg)
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x = Axis(min(xs), max(xs), frame.left, WIDTH - frame.right, log=log_x, base=x_base, ticks=8)
    y = Axis(0 if not log_y else min(ys), max(ys) * (1 if log_y else 1.08), frame.bottom, frame.top, log=log_y)
    frame.y_axis(svg, y, y_title, y_fmt)
    svg.line(frame.left, frame.bottom, WIDTH - frame.right, frame.bottom)
    for v in x.tick_values:
        svg.line(x(v), frame.bottom, x(v), frame.bottom + 5)
        svg.line(x(v), frame.top, x(v), frame.bottom, stroke="#f0f0f0")
        svg.text(x(v), frame.bottom + 18, x_fmt(v), size=11, anchor="middle")
    svg.text((frame.left + WIDTH - frame.right) / 2, frame.bottom + 40, x_title, size=12, anchor="middle")
    for s in series:
        colour = PALETTE[s.colour % len(PALETTE)]
        pixels = [(x(px), y(py)) for px, py in s.points]
        svg.polyline(pixels, colour, dash="6 4" if s.dashed else None)
        for (px, py), (sx, sy) in zip(s.points, pixels):
            svg.marker(sx, sy, s.marker, colour, tip=f"{s.label}: {x_fmt(px)}, {py:.4g}")
    return svg.render(title)


# --------------------------------------------------------------------------
# Markdown pieces


@dataclass
class Figure:
    slug: str
    title: str
    svg: str
    caption: str
    sources: list
    table: list  # rows, the first one the header
    notes: list = field(default_factory=list)


def md_cell(value):
    return str(value).replace("|", "\\|").replace("\n", " ")


def md_table(rows):
    out = ["| " + " | ".join(md_cell(c) for c in rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    out += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows[1:]]
    return "\n".join(out)


def footer_lines(sources):
    return [f"{s.file}: {s.gpu}; {s.date}; command: {s.command}" for s in sources]


# --------------------------------------------------------------------------
# Figure 1: memory per rank by category against N, measured and predicted

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
STATE_SLOTS = {"adamw": 2, "adam": 2, "lion": 1, "sgd": 1}  # fp32 moments per parameter
MEMORY_CATEGORIES = [("params", "params"), ("grads", "grads"), ("master", "fp32 master"),
                     ("optimizer_state", "optimizer state")]
BUFFERS = ("peak_buffers", "buffers (measured peak, not in the formula)")
MIB = 2 ** 20


def zero_prediction(numel, world, stage, param_bytes, grad_bytes, slots):
    """The ZeRO paper's persistent model state per rank, as zero::model_state_bytes
    counts it with one micro-step per step and no EMA or offload: params Ψp
    (Ψp/N at stage 3), grads Ψg (Ψg/N at 2-3), master Ψ·4 and K·Ψ·4 of optimizer
    state (both /N at stages 1-3)."""
    shard = numel / world
    owned = numel if stage == 0 else shard
    return {"params": (shard if stage == 3 else numel) * param_bytes,
            "grads": (numel if stage <= 1 else shard) * grad_bytes,
            "master": 0 if param_bytes == 4 else owned * 4,  # fp32 models need no master copy
            "optimizer_state": slots * owned * 4}


def memory_figure(res):
    names = sorted((os.path.relpath(p, res.folder) for p in glob.glob(res.path("cpu-engine-step-np*.json"))),
                   key=lambda n: int(re.search(r"np(\d+)", n).group(1)) if re.search(r"np(\d+)", n) else 0)
    names = [n for n in names if re.fullmatch(r"cpu-engine-step-np\d+\.json", n)]
    if not names:
        raise MissingInput("cpu-engine-step-np{1,2,4}.json")
    notes = [f"`cpu-engine-step-np{n}.json` is missing: N = {n} is left out." for n in (1, 2, 4)
             if f"cpu-engine-step-np{n}.json" not in names]
    runs = {}  # (stage, N) -> (measured, predicted, step ms, file, parameters)
    dtypes, recorded_prediction = set(), False
    for name in names:
        for rec in res.json(name).elems():
            stage, world = rec.whole("stage"), rec.whole("ranks")
            dtype = rec.text("dtype")
            if dtype not in DTYPE_BYTES:
                raise rec.error(f"unknown dtype {dtype!r}", "dtype")
            dtypes.add(dtype)
            optimizer = rec.text("optimizer").lower() if rec.has("optimizer") else "adamw"  # the bench runs AdamW
            if optimizer not in STATE_SLOTS:
                raise rec.error(f"unknown optimizer {optimizer!r}", "optimizer")
            memory = rec["memory_bytes_rank0"]
            measured = {key: memory.num(key) for key, _ in MEMORY_CATEGORIES}
            measured[BUFFERS[0]] = memory.num(BUFFERS[0]) if memory.has(BUFFERS[0]) else 0.0
            if rec.has("predicted_bytes_rank0"):  # a bench that records the planner's own numbers
                predicted = {key: rec["predicted_bytes_rank0"].num(key) for key, _ in MEMORY_CATEGORIES}
                recorded_prediction = True
            else:
                numel = rec.num("numel") if rec.has("numel") else rec.num("params")
                predicted = zero_prediction(numel, world, stage, DTYPE_BYTES[dtype], DTYPE_BYTES[dtype],
                                            STATE_SLOTS[optimizer])
            runs[(stage, world)] = (measured, predicted, rec.num("step_ms_median") if rec.has("step_ms_median")
                                    else None, name, rec.num("params"))
    stages = sorted({s for s, _ in runs})
    worlds = sorted({n for _, n in runs})
    colour_keys = [label for _, label in MEMORY_CATEGORIES] + [BUFFERS[1]]
    groups, clusters = [], []
    for stage in stages:
        count = 0
        for world in worlds:
            if (stage, world) not in runs:
                continue
            measured, predicted, *_ = runs[(stage, world)]
            bars = [Bar([(label, measured[key] / MIB) for key, label in MEMORY_CATEGORIES + [BUFFERS]],
                        tip="measured"),
                    Bar([(label, predicted[key] / MIB) for key, label in MEMORY_CATEGORIES], faint=True,
                        tip="predicted")]
            groups.append((f"N={world}", bars))
            count += 1
        clusters.append((f"stage {stage}", count))
    sources = [source_for(res, name) for name in names]
    params_millions = {round(r[4] / 1e6, 2) for r in runs.values()}
    title = "Memory per rank by category against N: measured (solid) and predicted (light)"
    svg = bar_chart(title, groups, "MiB per rank (rank 0)", footer_lines(sources), colour_keys, clusters=clusters,
                    faint_legend="predicted (right bar of each pair)",
                    x_title="ranks N, per ZeRO stage")
    deviation = max(abs(m[k] - p[k]) / p[k] for m, p, *_ in runs.values() for k, _ in MEMORY_CATEGORIES if p[k] > 0)
    dtype_text = " and ".join(f"{d} (p = g = {DTYPE_BYTES[d]} bytes)" for d in sorted(dtypes))
    caption = (
        f"Engine step bench (`bench_engine_step`, {', '.join(f'{p:g}' for p in sorted(params_millions))}M parameters, "
        f"{dtype_text} parameters and gradients, fp32 master and AdamW moments, CPU ranks over MPI): rank 0's "
        "bytes by category as the engine allocated them (solid) next to the prediction (light, dashed outline)"
        + (", as recorded in the JSON. " if recorded_prediction else
           ": the ZeRO formula of `zero::model_state_bytes`, params Ψ·p (Ψ·p/N at stage 3), grads Ψ·g (Ψ·g/N at "
           "stages 2-3), fp32 master Ψ·4 (Ψ·4/N at stages 1-3), AdamW state 2·Ψ·4 (/N at stages 1-3), with Ψ "
           "the JSON's `params` (the JSON carries no prediction of its own). ")
        + f"The measured model state matches the prediction to within {100 * deviation:.3f}% in every category"
        + (" (the engine pads Ψ to aligned buckets). " if deviation > 0 else ". ")
        + "Buffers are the engine's measured transient peak (bucket buffers, gathered units), which the formula "
        "does not count; the planner's replay (docs/planner.md) predicts them for the SDXL trainer only.")
    if len(stages) == 1:
        caption += f" Measured data exists for stage {stages[0]} only."
    header = ["stage", "N"] + [f"{label} (MiB, measured / predicted)" for _, label in MEMORY_CATEGORIES] + \
             ["buffers, measured (MiB)", "model state, measured / predicted (MiB)", "step (ms)"]
    table = [header]
    for (stage, world) in sorted(runs):
        measured, predicted, step_ms, *_ = runs[(stage, world)]
        cells = [f"{measured[k] / MIB:.1f} / {predicted[k] / MIB:.1f}" for k, _ in MEMORY_CATEGORIES]
        total_m = sum(measured[k] for k, _ in MEMORY_CATEGORIES)
        total_p = sum(predicted[k] for k, _ in MEMORY_CATEGORIES)
        table.append([stage, world] + cells + [f"{measured[BUFFERS[0]] / MIB:.1f}",
                                               f"{total_m / MIB:.1f} / {total_p / MIB:.1f}",
                                               "-" if step_ms is None else f"{step_ms:.0f}"])
    return Figure("memory-per-rank", title, svg, caption, sources, table, notes)


# --------------------------------------------------------------------------
# Figure 2: SDXL trainer images/s and MFU per stage and batch

FLOP_PER_IMAGE = 20.62e12  # SDXL UNet forward+backward, one 1024x1024 image (docs, sdxl-gpu.md)
PEAK_FLOPS = 989e12  # dense bf16 peak of an H100/H200 SXM
# Trainer summaries of other device scripts: (file, cluster label, script).
TRAINER_EXTRAS = [("offload/summary.json", "optimizer offload", "run_offload_device.sh"),
                  ("speed/summary.json", "no checkpointing", "run_speed_device.sh")]


RUN_WORDS = {"device": "on device", "nockpt": "no checkpointing", "nocudnnbench": "no cuDNN benchmark",
             "nooffload": "no offload", "params": "params offloaded", "noema": "no EMA", "cl": "channels-last",
             "graph": "CUDA graph"}


def run_label(rest):
    """'cap24-offload' -> '24 GiB cap, offload': the tail of the device scripts' run names."""
    words = [RUN_WORDS.get(w, re.sub(r"^cap(\d+)$", r"\1 GiB cap", w)) for w in rest.split("-") if w]
    return ", ".join(words) or "on device"


def sdxl_figure(res):
    # run_sdxl_train_device.sh writes sdxl-train-summary.json (a list of rows);
    # the recorded H200 runs were kept as sdxl-train-h200.json (rows under "runs"
    # with command, GPU and date). A fresh summary wins.
    name = "sdxl-train-summary.json" if res.exists("sdxl-train-summary.json") else "sdxl-train-h200.json"
    doc = res.json(name)
    rows = doc.elems() if doc.is_list() else doc.elems("runs")
    top = {} if doc.is_list() else {k: doc.text(k) for k in ("command", "gpu", "date") if doc.has(k)}
    if "gpu" not in top and rows[0].has("gpu"):
        top["gpu"] = rows[0].text("gpu")
    sources = [source_for(res, name, **top)]
    computed_mfu = []
    table = [["input", "stage", "batch", "run", "steps", "images/s", "MFU", "peak GPU memory (GiB)"]]

    def mfu_of(row, ips):
        if row.has("mfu"):
            return row.num("mfu")
        computed_mfu.append(row.path)
        return ips * FLOP_PER_IMAGE / PEAK_FLOPS

    def bar(row, ips, batch):
        return Bar([(f"batch {batch}", ips)], label=f"{ips:.2f}", tip=f"batch {batch}")

    def peak(row):  # the offload summaries call it between_steps_peak_gib since trainer_run.sh
        return next((f"{row.num(k):.2f}" for k in ("peak_gpu_memory_gib", "between_steps_peak_gib") if row.has(k)), "-")

    def steps(row):
        return row.whole("steps") if row.has("steps") else "-"
    by_stage, batches = {}, set()
    for row in rows:
        stage, batch, ips = row.whole("stage"), row.whole("batch"), row.num("images_per_s")
        by_stage.setdefault(stage, []).append((batch, bar(row, ips, batch)))
        batches.add(batch)
        table.append([name, stage, batch, row.text("name") if row.has("name") else "-", steps(row), f"{ips:.3f}",
                      f"{100 * mfu_of(row, ips):.1f}%", peak(row)])
    groups = [(f"stage {s}", [b for _, b in sorted(by_stage[s], key=lambda t: t[0])]) for s in sorted(by_stage)]
    clusters = [(f"trainer ({name})", len(groups))]
    notes = []
    for extra, what, script in TRAINER_EXTRAS:
        summary = res.json(extra, required=False)
        if summary is None:
            notes.append(f"`{extra}` is missing (from bench/gpu/{script}): its runs ({what}) are left out.")
            continue
        sources.append(source_for(res, extra))
        extra_groups = {}
        for row in summary.elems():
            run = row.text("name")
            match = re.fullmatch(r"sdxl-(?:1024-)?stage(\d+)-b(\d+)(?:-(.*))?", run)
            if not match:
                raise row.error(f"expected a run name like sdxl-stage2-b8-offload, got {run!r}", "name")
            stage, batch, rest = int(match.group(1)), int(match.group(2)), match.group(3) or ""
            ips = row.num("images_per_s")
            batches.add(batch)
            extra_groups.setdefault((stage, rest), []).append((batch, bar(row, ips, batch)))
            table.append([extra, stage, batch, run, steps(row), f"{ips:.3f}", f"{100 * mfu_of(row, ips):.1f}%",
                          peak(row)])
        for (stage, rest), bars in sorted(extra_groups.items()):
            groups.append((f"stage {stage}, {run_label(rest)}", [b for _, b in sorted(bars, key=lambda t: t[0])]))
        clusters.append((what, len(extra_groups)))
    unet = res.jsonl("sdxl-unet-fwdbwd.jsonl", required=False)
    if unet is None:
        notes.append("`sdxl-unet-fwdbwd.jsonl` is missing: the UNet-only reference is left out.")
    else:
        sources.append(source_for(res, "sdxl-unet-fwdbwd.jsonl"))
        by_ckpt = {}
        for rec in unet:
            if rec.has("pass") and rec.text("pass") != "forward+backward":
                continue
            batch, ips, ckpt = rec.whole("batch"), rec.num("images_per_s"), bool(rec["checkpointing"].value)
            batches.add(batch)
            by_ckpt.setdefault(ckpt, []).append((batch, bar(rec, ips, batch)))
            mfu = rec.num("mfu_vs_989") if rec.has("mfu_vs_989") else ips * FLOP_PER_IMAGE / PEAK_FLOPS
            peak_gib = f"{rec.num('peak_allocated_gib'):.2f} (allocated)" if rec.has("peak_allocated_gib") else "-"
            table.append(["sdxl-unet-fwdbwd.jsonl", "-", batch, "unet_bench" + (" --checkpointing" if ckpt else ""),
                          steps(rec), f"{ips:.3f}", f"{100 * mfu:.1f}%", peak_gib])
        for ckpt in sorted(by_ckpt, reverse=True):
            groups.append(("checkpointing" if ckpt else "no checkpointing",
                           [b for _, b in sorted(by_ckpt[ckpt], key=lambda t: t[0])]))
        clusters.append(("UNet fwd+bwd only, no optimizer", len(by_ckpt)))
    title = "SDXL trainer, 1024x1024 bf16, one GPU: images/s and MFU per ZeRO stage and batch"
    svg = bar_chart(title, groups, "images/s", footer_lines(sources), [f"batch {b}" for b in sorted(batches)],
                    clusters=clusters, y2=("MFU", FLOP_PER_IMAGE / PEAK_FLOPS, lambda v: f"{100 * v:g}%"))
    basis = doc.text("mfu_basis") if not doc.is_list() and doc.has("mfu_basis") else None
    caption = (
        "Mean images/s of the full SDXL UNet trainer (sdxl-1024.toml: bf16 with fp32 master, AdamW, EMA, "
        "activation checkpointing, synthetic data) after the warm-up steps, per ZeRO stage and batch; with one GPU "
        "(N = 1) the stages differ only in their bookkeeping. "
        "MFU = images/s × 20.62e12 FLOP per image / 989e12 FLOP/s (right axis)"
        + (f"; the JSON states its basis as \"{basis}\"" if basis else "") + ". "
        + ("MFU was computed here for the rows without an `mfu` field. " if computed_mfu else "")
        + "A run with fewer steps than asked was cut by its time limit (the device scripts' logs say so). The "
        "UNet-only bars (`unet_bench`, forward+backward, no optimizer) are the ceiling the trainer's step is "
        "measured against.")
    return Figure("sdxl-throughput", title, svg, caption, sources, table, notes)


# --------------------------------------------------------------------------
# Figure 3a: GPU optimizer kernels against the copy ceiling and LibTorch

GPU_KERNELS = ["zero_adamw_fp32", "zero_adamw_mixed_bf16", "zero_sgd_momentum_fp32", "zero_lion_fp32",
               "torch_fused_adamw_fp32"]


def gpu_optimizer_figure(res):
    name = "gpu-optimizer.json"
    doc = res.json(name)
    copy = doc["copy"].num("gb_per_s")
    device = doc["device"]
    gpu = device.text("name")
    if device.has("sms") and device.has("memory_bytes"):
        gpu += f" ({device.whole('sms')} SMs, {device.num('memory_bytes') / 2 ** 30:.1f} GiB)"
    sources = [source_for(res, name, gpu=gpu, date=doc.text("date_utc") if doc.has("date_utc") else None)]
    # Every kernel entry (an object with a name and GB/s), the known ones first;
    # the "_repeat" entries re-measure a kernel for noise, the sweeps are launch shapes.
    keys = [k for k in GPU_KERNELS if doc.has(k)]
    keys += [k for k, v in doc.value.items() if k not in keys and k != "copy" and isinstance(v, dict)
             and "gb_per_s" in v and "name" in v and not k.endswith("_repeat")]
    if "zero_adamw_fp32" not in keys:
        raise doc.error("missing", "zero_adamw_fp32")
    notes = [] if doc.has("torch_fused_adamw_fp32") else \
        ["LibTorch's fused AdamW is not in `gpu-optimizer.json` (built without LibTorch): its bar is left out."]
    colour_keys = ["zero", "LibTorch"]
    groups = []
    table = [["kernel", "bytes/param", "time (ms)", "G params/s", "GB/s", "% of copy"],
             ["device-to-device copy (ceiling)", "-", f"{doc['copy'].num('time_ms'):.3f}", "-", f"{copy:.0f}", "100"]]
    for key in keys:
        entry = doc[key]
        gbs = entry.num("gb_per_s")
        label = entry.text("name").replace("(default launch)", "").strip()
        groups.append((label, [Bar([("LibTorch" if key.startswith("torch") else "zero", gbs)],
                                   label=f"{100 * gbs / copy:.1f}%")]))
        table.append([label, f"{entry.num('bytes_per_param'):g}", f"{entry.num('time_ms'):.3f}",
                      f"{entry.num('params_per_s') / 1e9:.1f}", f"{gbs:.0f}", f"{100 * gbs / copy:.1f}"])
    params = doc.num("params") if doc.has("params") else None
    title = "GPU optimizer kernels against the copy bandwidth and LibTorch's fused AdamW"
    svg = bar_chart(title, groups, "GB/s (1e9 bytes, read + write)", footer_lines(sources), colour_keys,
                    ref_lines=[(f"device-to-device copy {copy:.0f} GB/s (ceiling)", copy)])
    speedup = doc.num("zero_over_torch_speedup") if doc.has("zero_over_torch_speedup") else None
    caption = (
        "One fused optimizer step over "
        + (f"2^{math.log2(params):.0f} = {params:.0f} fp32 parameters per tensor" if params else "the bench's tensors")
        + f", {doc.text('statistic') if doc.has('statistic') else 'median'} of "
        + f"{doc.whole('iters') if doc.has('iters') else '?'} timed runs: bytes moved per second against the "
        "device-to-device copy of the same GPU (the ceiling of a memory-bound kernel); the bar labels are the "
        "share of the copy bandwidth."
        + (f" zero's AdamW is {speedup:.3f}x LibTorch's `at::_fused_adamw_` on the same buffers." if speedup else "")
        + " The launch-shape sweeps in the JSON are tabulated in `gpu-kernels.md`.")
    return Figure("gpu-optimizer", title, svg, caption, sources, table, notes)


# --------------------------------------------------------------------------
# Figures 3b, 3c: CPU optimizer benches (Google Benchmark JSON)


def gbench_rows(doc):
    """{family: {size: benchmark node}}. Aggregates (median) win over single
    iterations when the run had repetitions."""
    rows, aggregated = {}, set()
    for bench in doc.elems("benchmarks"):
        parts = bench.text("name").split("/")
        sizes = [int(p) for p in parts[1:] if p.isdigit()]
        family, size = parts[0], sizes[0] if sizes else 0
        kind = bench.text("run_type") if bench.has("run_type") else "iteration"
        if kind == "aggregate":
            if bench.has("aggregate_name") and bench.text("aggregate_name") != "median":
                continue
            aggregated.add((family, size))
        elif (family, size) in aggregated:
            continue
        rows.setdefault(family, {})[size] = bench
    return rows


def gbench_figure(res, name, slug, title, families, metric, y_title, scale, ceiling, caption):
    """families: [(benchmark family, label)], known ones in this order; metric: the
    counter to plot (divided by scale); ceiling: the family that is the ceiling."""
    doc = res.json(name)
    rows = gbench_rows(doc)
    order = [f for f, _ in families if f in rows] + [f for f in rows if f not in dict(families)]
    labels = dict(families)
    sizes = sorted({s for f in order for s in rows[f]})
    groups = []
    for size in sizes:
        bars = [Bar([(labels.get(f, f), rows[f][size].num(metric) / scale)], label=f"{rows[f][size].num(metric) / scale:.3g}")
                for f in order if size in rows[f] and rows[f][size].has(metric)]
        groups.append((f"{size / 2 ** 20:g}M params" if size >= 2 ** 20 else f"{size} params", bars))
    source = gbench_source(res, name, doc)
    svg = bar_chart(title, groups, y_title, footer_lines([source]), [labels.get(f, f) for f in order],
                    x_title="tensor size (parameters)", colours={labels.get(ceiling, ceiling): "#999999"})
    other = "GB/s" if metric == "params/s" else "params/s"
    table = [["kernel", "params", f"{y_title}", "GB/s" if other == "GB/s" else "G params/s", "time",
              "vs ceiling"]]
    for f in order:
        for size in sorted(rows[f]):
            bench = rows[f][size]
            if not bench.has(metric):
                continue
            value = bench.num(metric) / scale
            ceiling_value = rows[ceiling][size].num(metric) / scale if ceiling in rows and size in rows[ceiling] and \
                rows[ceiling][size].has(metric) else None
            extra = bench.num(other) / (1 if other == "GB/s" else 1e9) if bench.has(other) else None
            table.append([labels.get(f, f), size, f"{value:.3g}", "-" if extra is None else f"{extra:.3g}",
                          f"{bench.num('real_time'):.3f} {bench.text('time_unit') if bench.has('time_unit') else ''}",
                          "-" if not ceiling_value else f"{value / ceiling_value:.2f}x"])
    host = gbench_host(doc)
    return Figure(slug, title, svg, caption + (f" Machine: {host}." if host else ""), [source], table)


def cpu_adamw_torch_figure(res):
    # run_suite.sh writes cpu-adamw-vs-torch.json; the recorded run on the H200
    # machine's host is cpu-adamw-vs-torch-h200host.json. A fresh run wins.
    name = "cpu-adamw-vs-torch.json" if res.exists("cpu-adamw-vs-torch.json") else "cpu-adamw-vs-torch-h200host.json"
    return gbench_figure(
        res, name, "cpu-adamw-vs-torch",
        "CPU AdamW (the offloaded optimizer) against LibTorch's CPU AdamW and the copy ceiling",
        [("BM_CopyCeiling", "copy of the same bytes (ceiling)"), ("BM_ZeroVectorized", "zero vectorized, fp32"),
         ("BM_ZeroVectorized_bf16grads_bf16copy", "zero vectorized, bf16 grads + bf16 copy"),
         ("BM_TorchFused", "LibTorch at::_fused_adamw_"), ("BM_TorchForeach", "LibTorch foreach"),
         ("BM_ZeroReference", "zero reference loop, 1 thread")],
        "params/s", "G params/s", 1e9, "BM_CopyCeiling",
        "One AdamW step on fp32 tensors in one process on the same data (`bench_cpu_adamw_vs_torch`, all "
        "intra-op threads): zero's vectorized kernel against LibTorch's fused and foreach CPU paths. The "
        "ceiling is a LibTorch copy of the same 28 bytes per parameter; at 16M parameters the data sits in "
        "the L3 cache, where the kernels can beat it.")


def cpu_optimizer_figure(res):
    return gbench_figure(
        res, "cpu-optimizer.json", "cpu-optimizer",
        "CPU optimizer kernels on the 2-core CI machine against memcpy",
        [("BM_Memcpy_Ceiling", "memcpy of the same bytes (ceiling)"),
         ("BM_AdamW_Vectorized_fp32", "AdamW vectorized, fp32 grads"),
         ("BM_AdamW_Reference_fp32", "AdamW reference loop, fp32 grads"),
         ("BM_AdamW_Vectorized_bf16grads_bf16copy", "AdamW vectorized, bf16 grads + copy"),
         ("BM_AdamW_Reference_bf16grads_bf16copy", "AdamW reference loop, bf16 grads + copy"),
         ("GradStats_bf16", "gradient statistics, bf16")],
        "GB/s", "GB/s", 1, "BM_Memcpy_Ceiling",
        "zero's CPU AdamW (`bench_cpu_optimizer`) in bytes moved per second against libc memcpy of the same "
        "bytes. At 16M parameters the vectorized kernel moves more bytes per second than memcpy, so memcpy is "
        "not a usable ceiling on this VM (`cpu-bench.md`).")


# --------------------------------------------------------------------------
# Figure 4: collective bus bandwidth against message size

COLLECTIVE_INPUTS = [("gpu-collectives-nccl-np1.json", "NCCL"), ("gpu-collectives-staged-np1.json", "staged (MPI)")]
OP_STYLE = {"reduce_scatter": (0, "circle"), "all_gather": (1, "square"), "all_reduce": (3, "triangle")}
TABLE_SIZES = {8, 2 ** 10, 2 ** 20, 2 ** 24, 2 ** 28, 2 ** 30}


def collectives_figure(res):
    present = [(n, label) for n, label in COLLECTIVE_INPUTS if res.exists(n)]
    if not present:
        raise MissingInput(*(n for n, _ in COLLECTIVE_INPUTS))
    notes = [f"`{n}` is missing: its curves are left out." for n, _ in COLLECTIVE_INPUTS if not res.exists(n)]
    loaded = []
    for name, label in present:
        doc = res.json(name)
        world = doc.whole("world_size")
        backend = doc.text("backend") if doc.has("backend") else label
        rows = [(row, row.text("op"), row.num("size"), row.num("algbw_gbps"), row.num("busbw_gbps"))
                for row in doc.elems("rows")]
        loaded.append((name, label, doc, world, backend, rows))
    # busbw is algbw x (N-1)/N (x 2(N-1)/N for all_reduce): 0 at world 1 by
    # definition, and nothing to draw on a log axis. Then algbw is drawn instead.
    use_busbw = any(bus > 0 for *_, rows in loaded for *_, bus in rows)
    metric = "busbw" if use_busbw else "algbw"
    series, dropped, table = [], [], [["input", "op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"]]
    wrong = 0
    for name, label, doc, world, backend, rows in loaded:
        by_op = {}
        for row, op, size, alg, bus in rows:
            wrong += row.whole("wrong") if row.has("wrong") else 0
            if size in TABLE_SIZES:
                table.append([name, op, fmt_bytes(size), f"{row.num('time_us'):.2f}", f"{alg:.3g}", f"{bus:.3g}",
                              row.whole("wrong") if row.has("wrong") else "-"])
            # NCCL returns at once from an in-place all_reduce on one rank: its
            # time is the call overhead and its bandwidth meaningless.
            if world == 1 and backend == "nccl" and op == "all_reduce":
                dropped.append(f"{label} all_reduce")
                continue
            value = bus if use_busbw else alg
            if value > 0:
                by_op.setdefault(op, []).append((size, value))
        for op, points in by_op.items():
            colour, marker = OP_STYLE.get(op, (4 + len(series), "circle"))
            series.append(Line(f"{label} {op}, N={world}", sorted(points), colour, backend != "nccl", marker))
    if not series:
        raise InputError(" and ".join(res.path(n) for n, _ in present), "rows", f"no row with {metric} above 0")
    sources = [source_for(res, name, gpu=doc.text("device") if doc.has("device") else None)
               for name, _, doc, *_ in loaded]
    title = f"Collective {'bus' if use_busbw else 'algorithm'} bandwidth against message size"
    svg = line_chart(title, series, "message size (bytes, log scale)", f"{metric} (GB/s, log scale)",
                     footer_lines(sources), x_fmt=fmt_bytes, log_x=True, log_y=True, x_base=2)
    worlds = sorted({world for _, _, _, world, *_ in loaded})
    caption = (
        f"nccl-tests' columns from `gpu_bench_collectives` (fp32, average of back-to-back calls) at N = "
        f"{', '.join(map(str, worlds))}: NCCL (solid) and the host-staged path over MPI (dashed), one colour and "
        "marker per collective. "
        + ("" if use_busbw else
           "Bus bandwidth is algbw × (N-1)/N (× 2(N-1)/N for all_reduce), which is 0 at N = 1 by definition in "
           "every row recorded, so the figure plots algorithm bandwidth (size / time) instead; busbw is in the "
           "table. ")
        + (f"Left out of the plot: {', '.join(sorted(set(dropped)))} (at N = 1 NCCL does nothing for an in-place "
           "all_reduce, so only the call is timed). " if dropped else "")
        + (f"#wrong was 0 in every row." if wrong == 0 else f"**{wrong} rows reported wrong results.**")
        + " The table shows selected sizes; every size is in the JSON.")
    return Figure("collectives", title, svg, caption, sources, table, notes)


# --------------------------------------------------------------------------
# The report

FIGURES = [
    ("Memory per rank by category against N (measured and predicted)", memory_figure),
    ("SDXL trainer: images/s and MFU per stage and batch", sdxl_figure),
    ("GPU optimizer kernels against the copy ceiling and LibTorch's fused AdamW", gpu_optimizer_figure),
    ("CPU AdamW against LibTorch's fused AdamW and the copy ceiling", cpu_adamw_torch_figure),
    ("CPU optimizer kernels against memcpy (CI machine)", cpu_optimizer_figure),
    ("Collective bandwidth against message size", collectives_figure),
]

# Why the inputs no figure reads are not plotted (by file name pattern).
UNPLOTTED = [
    (r".*\.md$", "hand-written summary: the source of command, GPU and date where a JSON lacks them"),
    (r".*\.log$", "run log"),
    (r".*\.smi$", "nvidia-smi memory samples of a trainer run"),
    (r"sdxl-train-h200-default-alloc\.json$", "rerun of sdxl-train-h200.json with LibTorch's default allocator "
                                              "(memory calibration, docs/planner.md); not plotted"),
    (r"sdxl-train-h200\.json$", "superseded by sdxl-train-summary.json from a fresh run"),
    (r"cpu-adamw-vs-torch-h200host\.json$", "superseded by cpu-adamw-vs-torch.json from a fresh run"),
    (r"provenance\.json$", "empty or not read"),
    (r"(.*/)?sdxl-.*\.jsonl$", "per-step trainer metrics, summarized in the summary JSON"),
    (r"tiny-gpu-stage\d\.jsonl$", "tiny trainer config on the GPU (a loss check, not a benchmark)"),
]


def unplotted_reason(name):
    return next((why for pattern, why in UNPLOTTED if re.fullmatch(pattern, name)), "not interpreted by this report")


def write_report(res, out, argv):
    figures_dir = os.path.join(out, "figures")
    os.makedirs(figures_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(figures_dir, "*.svg")):  # figures of an earlier report
        os.remove(stale)
    made, left_out = [], []
    for title, make in FIGURES:
        try:
            made.append(make(res))
        except MissingInput as missing:
            left_out.append((title, missing))
    lines = ["# Benchmark report", "",
             f"Generated {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by "
             f"`python3 bench/report/bench_report.py {' '.join(argv)}` from `{res.folder}`. "
             "Each figure lists the command, GPU and date of the runs it plots, and where those were read "
             "(the JSON itself, `provenance.json` written by `bench/report/run_suite.sh`, or the hand-written "
             "summary next to the JSON).", ""]
    for i, fig in enumerate(made, 1):
        lines.append(f"{i}. [{fig.title}](#figure-{i})")
    for title, missing in left_out:
        lines.append(f"- Left out: {title}: {missing.sentence()} from `{res.folder}`.")
    for i, fig in enumerate(made, 1):
        path = os.path.join(figures_dir, f"{i}-{fig.slug}.svg")
        with open(path, "w", encoding="utf-8") as f:
            f.write(fig.svg)
        lines += ["", f'<a id="figure-{i}"></a>', f"## Figure {i}. {fig.title}", "",
                  f"![{fig.title}](figures/{i}-{fig.slug}.svg)", "", fig.caption, ""]
        lines += [md_table([["input", "command", "GPU", "date", "read from"]] +
                           [[f"`{s.file}`", f"`{s.command}`", s.gpu, s.date, s.origin] for s in fig.sources]), ""]
        lines += [f"- {note}" for note in fig.notes] + ([""] if fig.notes else [])
        lines.append(md_table(fig.table))
    every = sorted(os.path.relpath(p, res.folder) for p in glob.glob(os.path.join(res.folder, "**", "*"), recursive=True)
                   if os.path.isfile(p) and not os.path.abspath(p).startswith(os.path.abspath(out) + os.sep))
    rest = [n for n in every if n not in res.used]
    if rest:
        lines += ["", "## Inputs not plotted", "", md_table([["file", "why"]] + [[f"`{n}`", unplotted_reason(n)]
                                                                               for n in rest])]
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return made, left_out


def main(argv):
    parser = argparse.ArgumentParser(description="Markdown report with SVG figures from bench/results.")
    parser.add_argument("--results", default="bench/results", help="folder of the recorded results")
    parser.add_argument("--out", default=None, help="output folder (default: <results>/report)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.results, "report")
    if not os.path.isdir(args.results):
        print(f"bench_report: error: results folder {args.results} does not exist", file=sys.stderr)
        return 2
    try:
        made, left_out = write_report(Results(args.results), out, argv)
    except InputError as e:
        print(f"bench_report: error: malformed input: {e}", file=sys.stderr)
        return 2
    print(f"bench_report: wrote {os.path.join(out, 'report.md')} with {len(made)} figures"
          + (f"; left out {len(left_out)}: " + "; ".join(m.sentence() for _, m in left_out) if left_out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
