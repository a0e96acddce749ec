"""Llumnix's published CI figures and its statistic."""

# Llumnix CI report 1 as posted: MiB -> GiB/s ("MB" and "GB/s" there are MiB and GiB/s).
_LLUMNIX_SIZES = [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128]
LLUMNIX = {
    "nccl": dict(zip(_LLUMNIX_SIZES + [136, 144, 152, 160, 168, 176, 184, 200, 208, 216, 232], [
        0.21, 0.47, 0.62, 0.79, 1.10, 1.28, 1.37, 1.54, 1.78, 1.85, 1.92, 1.87, 2.30, 1.83, 2.01,
        2.19, 2.19, 2.83, 2.50, 2.83, 4.06, 3.48, 3.54, 3.83, 3.77, 4.02, 3.38])),
    "gloo": dict(zip(_LLUMNIX_SIZES + [144, 152, 160, 168, 184, 192, 200, 224, 232, 240, 280, 304,
                                       312, 360, 384, 536], [
        0.88, 1.46, 1.85, 2.06, 2.10, 2.36, 2.56, 2.55, 2.43, 2.62, 2.38, 2.54, 2.66, 2.59, 2.48,
        2.49, 2.79, 2.86, 2.10, 1.47, 2.58, 1.31, 0.97, 2.15, 2.82, 1.80, 1.96, 0.42, 1.56, 1.64,
        0.50, 1.10])),
    "rayrpc": dict(zip(_LLUMNIX_SIZES + [136, 144, 152, 160, 168, 176, 184, 192, 200, 208, 216, 224,
                                         232, 248, 352, 360, 448, 472, 544, 1628], [
        0.89, 1.39, 1.66, 1.80, 1.93, 2.02, 2.14, 2.18, 2.14, 2.30, 2.28, 2.27, 2.32, 2.32, 2.38,
        2.43, 2.43, 2.45, 2.56, 2.52, 2.51, 2.62, 2.50, 2.73, 2.66, 2.65, 2.44, 2.79, 2.72, 2.63,
        3.18, 3.00, 3.18, 3.35, 3.36, 3.69])),
}



def llumnix_mean(values):
    """Llumnix's statistic: drop min and max, mean of the rest (plain mean below 3 samples)."""
    v = sorted(values)
    if len(v) >= 3:
        v = v[1:-1]
    return sum(v) / len(v)


def percentile99(values):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * 0.99))]
