#!/usr/bin/env python3
"""Checks of bench/report/bench_report.py (CTest: bench.report*).

  check_report.py report --out DIR [--generator G --results R] [--min-figures N]
      runs the generator (when given) on R into DIR, then fails unless
      DIR/report.md exists, every figure it references is a well-formed SVG,
      and every figure's section states command, GPU and date.
  check_report.py bad-input --generator G --results R --work DIR
      copies R to DIR, corrupts one JSON at a time (broken syntax; a key
      removed) and expects a non-zero exit whose message names the file (and
      the key), without a Python traceback.
  check_report.py missing-input --generator G --results R --work DIR
      removes inputs from a copy of R: the generator must still succeed and
      say in the report which file was missing.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
failures = []


def fail(message):
    failures.append(message)
    print(f"FAIL: {message}")


def run_generator(generator, results, out):
    proc = subprocess.run([sys.executable, generator, "--results", results, "--out", out],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def check_svg(path):
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        return fail(f"{path}: not well-formed XML: {e}")
    if root.tag != f"{SVG}svg":
        return fail(f"{path}: root element is {root.tag}, not an SVG <svg>")
    if not root.get("viewBox") and not (root.get("width") and root.get("height")):
        fail(f"{path}: neither a viewBox nor width and height")
    drawn = sum(1 for e in root.iter() if e.tag in (f"{SVG}rect", f"{SVG}line", f"{SVG}polyline"))
    if drawn < 10:
        fail(f"{path}: only {drawn} shapes; not a chart")
    if not any(e.tag == f"{SVG}text" and (e.text or "").strip() for e in root.iter()):
        fail(f"{path}: no text (axes, labels, legend)")


def table_rows(lines):
    """Markdown tables in lines -> [[cells of each row]] per table, header first."""
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r"-+", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def check_sources(title, lines):
    """The section's table whose header has command, GPU and date: every row filled."""
    for table in table_rows(lines):
        header = [c.lower() for c in table[0]]
        if all(key in header for key in ("command", "gpu", "date")):
            if len(table) < 2:
                return fail(f"section '{title}': the command/GPU/date table has no rows")
            for row in table[1:]:
                for key in ("command", "gpu", "date"):
                    value = row[header.index(key)].strip("` ") if header.index(key) < len(row) else ""
                    if not value or value.lower() == "not recorded":
                        fail(f"section '{title}': {key} of {row[0]} is '{value}'")
            return
    fail(f"section '{title}' has a figure but no table stating command, GPU and date")


def check_report(out, min_figures):
    report = os.path.join(out, "report.md")
    if not os.path.isfile(report):
        return fail(f"{report} does not exist")
    with open(report, encoding="utf-8") as f:
        lines = f.read().splitlines()
    sections, title = {}, "(top)"
    for line in lines:
        if line.startswith("## "):
            title = line[3:].strip()
        sections.setdefault(title, []).append(line)
    figures = 0
    for title, body in sections.items():
        refs = [m for line in body for m in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", line)]
        for ref in refs:
            figures += 1
            path = os.path.join(out, ref)
            if not ref.endswith(".svg"):
                fail(f"section '{title}': figure {ref} is not an SVG")
            elif not os.path.isfile(path):
                fail(f"section '{title}': figure {ref} does not exist")
            else:
                check_svg(path)
        if refs:
            check_sources(title, body)
    if figures < min_figures:
        left_out = [line for line in lines if "Left out" in line]
        fail(f"{figures} figures in {report}, expected at least {min_figures}" +
             (": " + " ".join(left_out) if left_out else ""))
    print(f"checked {report}: {figures} figures")


def fresh_copy(results, work):
    copy = os.path.join(work, "results")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(results, copy, ignore=shutil.ignore_patterns("report"))
    return copy


def expect_error(generator, results, work, name, corrupt, words):
    copy = fresh_copy(results, work)
    path = os.path.join(copy, name)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(corrupt(text))
    code, output = run_generator(generator, copy, os.path.join(work, "out"))
    print(f"{name}: exit {code}: {output.strip()}")
    if code == 0:
        fail(f"{name} corrupted: the generator exited 0")
    for word in [name] + words:
        if word not in output:
            fail(f"{name} corrupted: '{word}' is not in the message")
    if "Traceback" in output:
        fail(f"{name} corrupted: a Python traceback instead of a message")


def drop_first_images_per_s(text):
    doc = json.loads(text)
    del doc["runs"][0]["images_per_s"]
    return json.dumps(doc)


def bad_input(generator, results, work):
    expect_error(generator, results, work, "gpu-optimizer.json", lambda t: t[: len(t) // 2], [])
    expect_error(generator, results, work, "sdxl-train-h200.json", drop_first_images_per_s, ["images_per_s"])
    expect_error(generator, results, work, "cpu-engine-step-np2.json",
                 lambda t: t.replace('"stage": 1', '"stage": "one"', 1), ["stage"])


def missing_input(generator, results, work):
    copy = fresh_copy(results, work)
    removed = ["gpu-optimizer.json", "offload/summary.json", "cpu-engine-step-np4.json"]
    for name in removed:
        os.remove(os.path.join(copy, name))
    out = os.path.join(work, "out")
    code, output = run_generator(generator, copy, out)
    print(f"without {', '.join(removed)}: exit {code}: {output.strip()}")
    if code != 0:
        return fail(f"a missing input made the generator fail (exit {code})")
    with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
        report = f.read()
    for name in removed:
        if not re.search(rf"`{re.escape(name)}`[^\n]*missing", report):
            fail(f"the report does not say that {name} is missing")
    check_report(out, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["report", "bad-input", "missing-input"])
    parser.add_argument("--generator")
    parser.add_argument("--results")
    parser.add_argument("--out")
    parser.add_argument("--work")
    parser.add_argument("--min-figures", type=int, default=1)
    args = parser.parse_args()
    if args.mode == "report":
        if args.generator:
            code, output = run_generator(args.generator, args.results, args.out)
            print(output.strip())
            if code != 0:
                fail(f"the generator exited {code}")
        check_report(args.out, args.min_figures)
    elif args.mode == "bad-input":
        bad_input(args.generator, args.results, args.work)
    else:
        missing_input(args.generator, args.results, args.work)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
