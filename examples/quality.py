"""Image quality against a reference: PSNR and SSIM (the benchmarks' yardsticks for approximate speed-ups).

Both take float images in [0, 1], [..., H, W, 3] (a batch or a video's frames), and compare the luma.
SSIM is Wang et al. 2004: an 11-tap Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03.
"""

from __future__ import annotations

import numpy as np
import torch


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    mse = float(((np.asarray(image, np.float64) - np.asarray(reference, np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def ssim(image: np.ndarray, reference: np.ndarray) -> float:
    x, y = _luma(image), _luma(reference)  # [N, 1, H, W]
    size = min(11, x.shape[-1], x.shape[-2])
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * 1.5 ** 2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]

    def blur(t):
        return torch.nn.functional.conv2d(t, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return float(s.mean())


def _luma(image: np.ndarray) -> torch.Tensor:
    a = torch.as_tensor(np.asarray(image, np.float64))
    a = a.reshape(-1, *a.shape[-3:])
    luma = 0.299 * a[..., 0] + 0.587 * a[..., 1] + 0.114 * a[..., 2]
    return luma[:, None]
