"""piper.plot's SVG writer: a scatter or line chart with linear or log axes, "nice" ticks, a title,
axis labels and a legend, as piper plot draws its PNGs (plot/src/plot.cpp), in plain SVG 1.1."""
import math
import os
import tempfile
from xml.sax.saxutils import escape

# Okabe-Ito, as plot/src/plot.cpp's palette.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
WIDTH, HEIGHT = 1100, 720
LEFT, RIGHT, TOP, BOTTOM = 90, 30, 50, 70


def nice_ticks(lo, hi, log, target=6):
    """Multiples of 1, 2 or 5 x 10^k over [lo, hi] (linear); on a log axis the powers of ten, with
    2 and 5 (then every digit) between them when there are few decades, else linear ticks."""
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        for mults in ((1,), (1, 2, 5), tuple(range(1, 10))):
            ticks = [m * 10.0 ** k for k in range(a, b + 1) for m in mults if lo <= m * 10.0 ** k <= hi]
            if len(ticks) >= 3:
                return ticks
        return [t for t in nice_ticks(lo, hi, False, target) if t > 0]
    span = hi - lo
    raw = span / max(1, target)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10)), key=lambda st: abs(span / st - target))
    first = math.ceil(lo / step - 1e-9) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(0.0 if abs(v) < step * 1e-9 else v)
        v += step
    return out


def tick_label(v):
    """Compact, with k/M/G/T suffixes for large magnitudes ("1.5k", "20M", "0.25")."""
    a = abs(v)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= scale:
            return f"{v / scale:.4g}{suffix}"
    return f"{v:.4g}"


def _range(values, log):
    lo, hi = min(values), max(values)
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if lo == hi:
        lo, hi = lo - 1 if log else lo - (abs(lo) or 1) * 0.1, hi + 1 if log else hi + (abs(hi) or 1) * 0.1
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    return (10 ** lo, 10 ** hi) if log else (lo, hi)


def write(path, series, title, x_label, y_label, line=False, log_x=False, log_y=False):
    """series: [(name, xs, ys)]. Points with a non-positive value on a log axis are left out.
    Written to a temporary file, then renamed (nothing half-written)."""
    kept = []
    for name, xs, ys in series:
        pts = [(x, y) for x, y in zip(xs, ys) if (not log_x or x > 0) and (not log_y or y > 0)]
        if line:
            pts.sort()
        if pts:
            kept.append((name, pts))
    if not kept:
        raise ValueError("no point left to draw (log axes drop values <= 0)")
    all_x = [p[0] for _, pts in kept for p in pts]
    all_y = [p[1] for _, pts in kept for p in pts]
    x0, x1 = _range(all_x, log_x)
    y0, y1 = _range(all_y, log_y)
    names = [name for name, _ in kept if name]
    # The legend sits right of the plot area (never over the points): about 7 px a character.
    legend_w = 40 + 7 * max(len(n) for n in names) if names else 0
    pw, ph = WIDTH - LEFT - RIGHT - legend_w, HEIGHT - TOP - BOTTOM

    def sx(v):
        f = (math.log10(v) - math.log10(x0)) / (math.log10(x1) - math.log10(x0)) if log_x else (v - x0) / (x1 - x0)
        return LEFT + f * pw

    def sy(v):
        f = (math.log10(v) - math.log10(y0)) / (math.log10(y1) - math.log10(y0)) if log_y else (v - y0) / (y1 - y0)
        return TOP + ph - f * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="13">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    if title:
        out.append(f'<text x="{WIDTH / 2}" y="28" text-anchor="middle" font-size="16">{escape(title)}</text>')
    out.append(f'<g class="axes" stroke="#333" fill="none"><rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}"/></g>')
    out.append('<g class="ticks" font-size="12">')
    for t in nice_ticks(x0, x1, log_x):
        px = sx(t)
        out.append(f'<line x1="{px:.2f}" y1="{TOP}" x2="{px:.2f}" y2="{TOP + ph}" stroke="#e5e5e5"/>'
                   f'<text x="{px:.2f}" y="{TOP + ph + 18}" text-anchor="middle">{escape(tick_label(t))}</text>')
    for t in nice_ticks(y0, y1, log_y):
        py = sy(t)
        out.append(f'<line x1="{LEFT}" y1="{py:.2f}" x2="{LEFT + pw}" y2="{py:.2f}" stroke="#e5e5e5"/>'
                   f'<text x="{LEFT - 8}" y="{py + 4:.2f}" text-anchor="end">{escape(tick_label(t))}</text>')
    out.append('</g>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 20}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(22 {TOP + ph / 2}) rotate(-90)" text-anchor="middle">{escape(y_label)}</text>')
    legend = []
    for i, (name, pts) in enumerate(kept):
        color = PALETTE[i % len(PALETTE)]
        out.append(f'<g class="series" fill="{color}" stroke="{color}">')
        if line and len(pts) > 1:
            d = " ".join(f"{sx(x):.2f},{sy(y):.2f}" for x, y in pts)
            out.append(f'<polyline fill="none" stroke-width="2" points="{d}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{sx(x):.2f}" cy="{sy(y):.2f}" r="4"/>')
        out.append('</g>')
        if name:
            legend.append((name, color))
    if legend:
        out.append('<g class="legend">')
        for i, (name, color) in enumerate(legend):
            ly = TOP + 16 + 20 * i
            lx = LEFT + pw + 20
            out.append(f'<circle cx="{lx}" cy="{ly - 4}" r="5" fill="{color}"/>'
                       f'<text x="{lx + 12}" y="{ly}">{escape(name)}</text>')
        out.append('</g>')
    out.append('</svg>\n')
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".piper-plot-", suffix=".svg", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(out))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
