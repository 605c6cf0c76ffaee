#!/usr/bin/env python3
"""Reads TensorBoard event files and prints their scalars.

Cross-checks the SDXL trainer's TensorBoardWriter (examples/sdxl/metrics) against
TensorBoard itself: with the `tensorboard` package installed, the files are read
by its EventAccumulator, i.e. the way `tensorboard --logdir` reads them. Without
it, a decoder written here from the format (TFRecord framing with masked CRC-32C,
protobuf wire format, the field numbers of event.proto and summary.proto) reads
them instead, so the check also runs where only Python's standard library is.

    tools/check_tfevents.py RUN_DIR_OR_FILE...            # a summary per tag
    tools/check_tfevents.py --json out/tb                 # every point as JSON
    tools/check_tfevents.py --cross-check out/tb          # both readers must agree
    tools/check_tfevents.py --expect-tags train/loss,train/lr out/tb

Exit status: 0 when every file reads cleanly (and, with --cross-check, both
readers return the same points; with --expect-tags, every tag is present),
1 otherwise.
"""

import argparse
import json
import math
import os
import struct
import sys

# ------------------------------------------------------------------ pure decoder


def _crc32c_table():
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class FormatError(Exception):
    pass


def read_records(path):
    """Yields the payload of every TFRecord in the file, checking both CRCs."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        if len(data) - pos < 12:
            raise FormatError(f"{len(data) - pos} trailing bytes at offset {pos}, not a whole record")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if length_crc != masked_crc32c(header):
            raise FormatError(f"bad length CRC of the record at offset {pos}")
        end = pos + 12 + length
        if end + 4 > len(data):
            raise FormatError(f"the record at offset {pos} is cut short")
        payload = data[pos + 12:end]
        (data_crc,) = struct.unpack("<I", data[end:end + 4])
        if data_crc != masked_crc32c(payload):
            raise FormatError(f"bad data CRC of the record at offset {pos}")
        yield payload
        pos = end + 4


def _varint(buf, pos):
    value = 0
    shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FormatError("bad varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def parse_message(buf):
    """A protobuf message as a list of (field number, wire type, value)."""
    fields = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise FormatError(f"unsupported wire type {wire}")
        if pos > len(buf):
            raise FormatError("field runs past the end of its message")
        fields.append((number, wire, value))
    return fields


def _int64(value):
    return value - (1 << 64) if value >= 1 << 63 else value


def decode_image(payload):
    """Summary.Image {height = 1, width = 2, colorspace = 3, encoded_image_string = 4}."""
    image = {"height": 0, "width": 0, "colorspace": 0, "encoded": b""}
    for number, wire, value in parse_message(payload):
        if number in (1, 2, 3) and wire == 0:
            image[("height", "width", "colorspace")[number - 1]] = _int64(value)
        elif number == 4 and wire == 2:
            image["encoded"] = value
    return image


def pure_images(path):
    """{tag: [(step, image dict)]} of the image summaries (no TensorBoard needed)."""
    images = {}
    for payload in read_records(path):
        event = decode_event(payload)
        for tag, image in event.get("images", []):
            images.setdefault(tag, []).append((event["step"], image))
    return images


def png_problem(image):
    """None when image["encoded"] is a PNG of the summary's size, else what is wrong."""
    data = image["encoded"]
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    if (width, height) != (image["width"], image["height"]):
        return f"PNG is {width}x{height}, summary says {image['width']}x{image['height']}"
    return None


def decode_event(payload):
    event = {"wall_time": 0.0, "step": 0}
    for number, wire, value in parse_message(payload):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = _int64(value)
        elif number == 3 and wire == 2:
            event["file_version"] = value.decode("utf-8")
        elif number == 5 and wire == 2:
            values = []
            for vnumber, vwire, vvalue in parse_message(value):
                if vnumber != 1 or vwire != 2:
                    continue
                tag, simple, image = None, None, None
                for fnumber, fwire, fvalue in parse_message(vvalue):
                    if fnumber == 1 and fwire == 2:
                        tag = fvalue.decode("utf-8", errors="replace")
                    elif fnumber == 2 and fwire == 5:
                        simple = struct.unpack("<f", fvalue)[0]
                    elif fnumber == 4 and fwire == 2:
                        image = decode_image(fvalue)
                if image is not None:
                    event.setdefault("images", []).append((tag, image))
                else:
                    values.append((tag, simple))
            event["summary"] = values
        elif number == 7 and wire == 2:
            for snumber, swire, svalue in parse_message(value):
                if snumber == 1 and swire == 0:
                    event["session_status"] = svalue
    return event


def pure_scalars(path):
    """{tag: [(step, wall_time, value)]}, applying SessionLog.START the way
    TensorBoard does: a restart at step S drops the points at steps >= S."""
    scalars = {}
    first = True
    for payload in read_records(path):
        event = decode_event(payload)
        if first and not event.get("file_version", "").startswith("brain.Event:"):
            raise FormatError("the first record is not a file_version event")
        first = False
        if event.get("session_status") == 1:
            for tag in scalars:
                scalars[tag] = [p for p in scalars[tag] if p[0] < event["step"]]
        for tag, value in event.get("summary", []):
            if tag is not None and value is not None:
                scalars.setdefault(tag, []).append((event["step"], event["wall_time"], value))
    return scalars


# ------------------------------------------------------------------ TensorBoard's reader


def tensorboard_scalars(path):
    from tensorboard.backend.event_processing import event_accumulator

    # size_guidance 0 keeps every point instead of a reservoir sample.
    accumulator = event_accumulator.EventAccumulator(path, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.wall_time, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def have_tensorboard():
    try:
        import tensorboard.backend.event_processing.event_accumulator  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------ main


def event_files(paths):
    for path in paths:
        if os.path.isdir(path):
            for root, _, names in sorted(os.walk(path)):
                for name in sorted(names):
                    if "tfevents" in name:
                        yield os.path.join(root, name)
        else:
            yield path


def same_points(a, b):
    if a.keys() != b.keys():
        return False
    for tag in a:
        if len(a[tag]) != len(b[tag]):
            return False
        for (s1, w1, v1), (s2, w2, v2) in zip(a[tag], b[tag]):
            if s1 != s2 or not math.isclose(w1, w2, rel_tol=0, abs_tol=1e-6):
                return False
            if not (v1 == v2 or (math.isnan(v1) and math.isnan(v2))):
                return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="event files, or directories searched for *tfevents*")
    parser.add_argument("--json", action="store_true", help="print {file: {tag: [[step, wall_time, value]]}}")
    parser.add_argument("--pure", action="store_true", help="use the built-in decoder even if tensorboard is installed")
    parser.add_argument("--cross-check", action="store_true", help="read with both readers and compare (needs tensorboard)")
    parser.add_argument("--expect-tags", default="", help="comma-separated tags that every file must contain")
    parser.add_argument("--expect-images", default="",
                        help="comma-separated tags that must hold PNG image summaries (read by the built-in "
                             "decoder; each PNG's IHDR size must match the summary's height and width)")
    args = parser.parse_args()

    use_tensorboard = have_tensorboard() and not args.pure
    if args.cross_check and not have_tensorboard():
        print("--cross-check needs the tensorboard package (pip install tensorboard)", file=sys.stderr)
        return 1
    files = list(event_files(args.paths))
    if not files:
        print("no event files found", file=sys.stderr)
        return 1

    ok = True
    report = {}
    expected = [t for t in args.expect_tags.split(",") if t]
    expected_images = [t for t in args.expect_images.split(",") if t]
    if expected_images:
        found = {}
        for path in files:
            try:
                for tag, entries in pure_images(path).items():
                    found.setdefault(tag, []).extend(entries)
            except (FormatError, OSError) as error:
                print(f"{path}: {error}", file=sys.stderr)
                ok = False
        for tag in expected_images:
            if tag not in found:
                print(f"no image summary tagged {tag!r}", file=sys.stderr)
                ok = False
            for step, image in found.get(tag, []):
                problem = png_problem(image)
                if problem:
                    print(f"image {tag!r} at step {step}: {problem}", file=sys.stderr)
                    ok = False
    for path in files:
        try:
            points = pure_scalars(path) if not use_tensorboard else tensorboard_scalars(path)
            if args.cross_check:
                pure = pure_scalars(path)
                theirs = tensorboard_scalars(path)
                if not same_points(pure, theirs):
                    print(f"{path}: MISMATCH between the built-in decoder and TensorBoard", file=sys.stderr)
                    ok = False
                else:
                    print(f"{path}: built-in decoder and TensorBoard agree", file=sys.stderr)
        except (FormatError, OSError) as error:
            print(f"{path}: {error}", file=sys.stderr)
            ok = False
            continue
        for tag in expected:
            if tag not in points:
                print(f"{path}: tag {tag!r} missing", file=sys.stderr)
                ok = False
        report[path] = points

    reader = "tensorboard EventAccumulator" if use_tensorboard else "built-in decoder"
    if args.json:
        print(json.dumps({p: {t: [list(x) for x in v] for t, v in s.items()} for p, s in report.items()}, indent=1))
    else:
        for path, scalars in report.items():
            print(f"{path} ({reader})")
            for tag in sorted(scalars):
                pts = scalars[tag]
                print(f"  {tag:32s} {len(pts):7d} points  steps {pts[0][0]}..{pts[-1][0]}  last {pts[-1][2]:.6g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
