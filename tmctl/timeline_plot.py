"""A job's timeline as a PNG (matplotlib, Agg backend): step time against time, migrations and incidents shaded.

:func:`draw` turns a :meth:`tmd.timeline.Timeline.to_dict` dict into a PNG file; :func:`count_bands` counts, from
the picture alone, how many migrations and incidents it shows; :func:`png_description` reads the counts the PNG
carries in its metadata. Imported lazily (``tmctl timeline --png``, the benchmarks): ``tmctl status`` never loads
matplotlib.

The picture (``width_px`` x ``height_px`` pixels, exactly):

- the step time (seconds, y) of each step against seconds since the timeline's start (x);
- each span's phases shaded over the whole height, below the strip (migrations in blues, incidents in reds, a
  lighter shade per phase), a running span up to the timeline's end; hatched over when it aborted or failed
  (``xx``), was superseded (``\\\\``) or is still running (``..``);
- marks as vertical lines: a failed node dashed black, a straggler dotted orange, the job's failure solid red;
- a reserved strip in the top :data:`STRIP_FRACTION` of the axes holding one solid band per span: migrations in
  the upper row in exactly :data:`MIGRATION_BAND` (RGB), incidents in the lower row in exactly
  :data:`INCIDENT_BAND`; drawn without antialiasing, each band at least :data:`MIN_BAND_PX` pixels wide and
  :data:`BAND_GAP_PX` pixels from the next band of its row (spans closer than that are pushed apart), so the
  number of contiguous runs of a band colour along a pixel row is the number of spans of that kind (as long as
  they fit: about axes width / (MIN_BAND_PX + BAND_GAP_PX) spans, 150 for the default size).
- the PNG's ``Description`` metadata: JSON ``{"migration": n, "incident": n, "marks": n, "steps": n}``.
"""
from __future__ import annotations

import json
import struct
import time
from typing import Any, Optional

from tmd.timeline import MarkKind, Outcome, SpanKind

MIGRATION_BAND = (0x1F, 0x4E, 0xB4)  # RGB of a migration's band in the strip
INCIDENT_BAND = (0xC8, 0x1E, 0x1E)  # RGB of an incident's band in the strip
BAND_COLORS = {SpanKind.MIGRATION: MIGRATION_BAND, SpanKind.INCIDENT: INCIDENT_BAND}
STRIP_FRACTION = 0.04  # top share of the axes' height reserved for the bands (nothing else is drawn there)
MIN_BAND_PX = 3  # narrowest band (pixels)
BAND_GAP_PX = 2  # fewest background pixels between two bands of one row
WIDTH_PX, HEIGHT_PX, DPI = 1200, 500, 100

_PHASE_SHADES = {  # kind -> shades cycled over its phases, in order (light enough for the step line to show)
    SpanKind.MIGRATION: ["#dbe7fb", "#c4d8f7", "#a9c6f2", "#8fb4ec", "#7aa5e6", "#6a98e0"],
    SpanKind.INCIDENT: ["#fbe0dc", "#f7c7bf", "#f2ab9f", "#ec9282", "#e67d6b"],
}
_OUTCOME_HATCH = {Outcome.ABORTED: "xx", Outcome.FAILED: "xx", Outcome.SUPERSEDED: "\\\\", Outcome.RUNNING: ".."}
_MARK_STYLE = {MarkKind.NODE_FAILED: {"color": "black", "linestyle": "--"},
               MarkKind.STRAGGLER: {"color": "#e08a00", "linestyle": ":"},
               MarkKind.JOB_FAILED: {"color": "#a00000", "linestyle": "-"}}
_STEP_LABEL = "step time"  # the step-time line's legend entry (listed first)
_LEFT, _RIGHT, _BOTTOM, _TOP = 0.07, 0.70, 0.12, 0.90  # the axes' place in the figure (fractions)


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#%02x%02x%02x" % rgb


def band_layout(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[int, int]]:
    """Pixel columns ``[a, b)`` of each band (``spans``: pixel x of start and end, sorted by start), within
    ``[lo, hi)``: at least MIN_BAND_PX wide, BAND_GAP_PX apart; pushed left from the right edge when needed."""
    out: list[list[int]] = []
    prev_end = int(lo) - BAND_GAP_PX
    for x0, x1 in spans:
        a = max(int(round(x0)), prev_end + BAND_GAP_PX, int(lo))
        b = max(int(round(x1)), a + MIN_BAND_PX)
        out.append([a, b])
        prev_end = b
    next_start = int(hi) + BAND_GAP_PX
    for band in reversed(out):  # anything pushed past the right edge comes back, keeping the gaps
        band[1] = min(band[1], next_start - BAND_GAP_PX)
        band[0] = min(band[0], band[1] - MIN_BAND_PX)
        next_start = band[0]
    return [(a, b) for a, b in out]


def draw(timeline: dict, path: str, *, title: Optional[str] = None, width_px: int = WIDTH_PX,
         height_px: int = HEIGHT_PX) -> dict:
    """Write ``timeline`` (a ``Timeline.to_dict()``) as a ``width_px`` x ``height_px`` PNG at ``path``; returns
    the counts written to its metadata (``migration``, ``incident``, ``marks``, ``steps``). Raises OSError when
    ``path`` cannot be written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.transforms import IdentityTransform

    steps = [s for s in timeline.get("steps") or [] if isinstance(s, (list, tuple)) and len(s) == 3]
    spans = [s for s in timeline.get("spans") or [] if isinstance(s, dict) and s.get("kind") in BAND_COLORS]
    marks = [m for m in timeline.get("marks") or [] if isinstance(m, dict)]
    t0 = timeline.get("start") or min([s[1] for s in steps] + [s["start"] for s in spans], default=0.0)
    t_end = timeline.get("end") or max([s[1] for s in steps] + [t0], default=t0)
    width_s = max(t_end - t0, 1.0)

    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    FigureCanvasAgg(fig)  # the Agg canvas, without pyplot: no global state, never a display
    ax = fig.add_axes((_LEFT, _BOTTOM, _RIGHT - _LEFT, _TOP - _BOTTOM))
    ax.set_xlim(0.0, width_s * 1.01)
    top_data = max([s[2] for s in steps], default=1.0) or 1.0
    ax.set_ylim(0.0, top_data * 1.1 / (1.0 - STRIP_FRACTION - 0.02))
    below_strip = 1.0 - STRIP_FRACTION - 0.01  # shading and mark lines stay under the strip

    legend: dict[str, Any] = {}
    for span in spans:
        kind = span["kind"]
        shades = _PHASE_SHADES[kind]
        end = span.get("end") if span.get("end") is not None else t_end
        phases = [ph for ph in span.get("phases") or [] if isinstance(ph, dict)]
        if not phases:
            phases = [{"name": kind, "start": span["start"], "end": end}]
        for i, ph in enumerate(phases):
            ph_end = ph.get("end") if ph.get("end") is not None else end
            shade = shades[i % len(shades)]
            ax.axvspan(ph["start"] - t0, ph_end - t0, ymin=0.0, ymax=below_strip, color=shade, linewidth=0,
                       zorder=0)
            legend.setdefault(f"{kind}: {ph.get('name')}", Patch(facecolor=shade, edgecolor="none"))
        hatch = _OUTCOME_HATCH.get(span.get("outcome"))
        if hatch:  # an aborted or failed span (or one still running) is hatched over its shading
            ax.axvspan(span["start"] - t0, end - t0, ymin=0.0, ymax=below_strip, facecolor="none",
                       edgecolor="#555555", hatch=hatch, linewidth=0, zorder=1)
            legend.setdefault(f"{span.get('outcome')}", Patch(facecolor="white", edgecolor="#555555", hatch=hatch))
    for m in marks:
        style = _MARK_STYLE.get(m.get("kind"), {"color": "gray", "linestyle": "-."})
        ax.axvline(m["ts"] - t0, ymin=0.0, ymax=below_strip, linewidth=1.2, zorder=3, **style)
        legend.setdefault(str(m.get("kind")), Line2D([], [], linewidth=1.2, **style))
    if steps:
        xs = [s[1] - t0 for s in steps]
        ys = [s[2] for s in steps]
        ax.plot(xs, ys, color="#202020", linewidth=0.9, marker=".", markersize=2.5, zorder=4)
        legend[_STEP_LABEL] = Line2D([], [], color="#202020", linewidth=0.9, marker=".")
    ax.set_xlabel(f"seconds since {time.strftime('%H:%M:%S', time.localtime(t0))}")
    ax.set_ylabel("step time (s)")
    counts = {str(k): sum(1 for s in spans if s["kind"] == k) for k in BAND_COLORS}
    head = title or f"job {timeline.get('job') or '?'}"
    ax.set_title(f"{head}: {counts[SpanKind.MIGRATION]} migration(s), {counts[SpanKind.INCIDENT]} incident(s)",
                 loc="left", fontsize=10)
    if legend:
        names = [_STEP_LABEL] if _STEP_LABEL in legend else []
        names += [n for n in legend if n != _STEP_LABEL]
        ax.legend([legend[n] for n in names], names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  frameon=False)

    # The strip: bands in display pixels (the axes' place is fixed, so this is exact at savefig's dpi).
    box = ax.bbox
    strip_px = max(int(box.height * STRIP_FRACTION), 8)
    row_h = max((strip_px - 3) // 2, 3)
    top = int(box.y1) - 2
    rows = {SpanKind.MIGRATION: (top - row_h, top), SpanKind.INCIDENT: (top - 2 * row_h - 1, top - row_h - 1)}
    to_px = ax.transData.transform
    for kind, rgb in BAND_COLORS.items():
        mine = sorted((s for s in spans if s["kind"] == kind), key=lambda s: s["start"])
        pixels = [(to_px((s["start"] - t0, 0))[0],
                   to_px(((s["end"] if s.get("end") is not None else t_end) - t0, 0))[0]) for s in mine]
        y0, y1 = rows[kind]
        for a, b in band_layout(pixels, box.x0 + 1, box.x1 - 1):
            fig.add_artist(Rectangle((a, y0), b - a, y1 - y0, transform=IdentityTransform(), facecolor=_hex(rgb),
                                     edgecolor="none", linewidth=0, antialiased=False, zorder=10))
    info = {**counts, "marks": len(marks), "steps": len(steps)}
    fig.savefig(path, format="png", dpi=DPI, metadata={"Description": json.dumps(info)})
    return info


def count_bands(png_path: str) -> dict[str, int]:
    """How many spans of each kind (``migration``, ``incident``) a PNG drawn by :func:`draw` shows: the most
    contiguous runs of that kind's band colour along any one pixel row."""
    import matplotlib.image

    img = matplotlib.image.imread(png_path)
    if img.dtype.kind == "f":
        img = (img[..., :3] * 255.0 + 0.5).astype("int32")
    else:
        img = img[..., :3].astype("int32")
    out = {}
    for kind, rgb in BAND_COLORS.items():
        hit = ((img[..., 0] == rgb[0]) & (img[..., 1] == rgb[1]) & (img[..., 2] == rgb[2])).astype("int8")
        # a run starts where a pixel matches and the one to its left does not
        starts = hit[:, 1:] & (1 - hit[:, :-1])
        runs = starts.sum(axis=1) + hit[:, 0]
        out[str(kind)] = int(runs.max()) if runs.size else 0
    return out


def png_description(png_path: str) -> Optional[dict]:
    """The JSON of a PNG's ``Description`` text chunk (what :func:`draw` wrote), or None."""
    with open(png_path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    pos = 8
    while pos + 8 <= len(data):
        length, ctype = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if ctype == b"tEXt" and b"\x00" in body:
            key, value = body.split(b"\x00", 1)
            if key == b"Description":
                try:
                    return json.loads(value.decode("latin-1"))
                except ValueError:
                    return None
        pos += 12 + length
    return None
