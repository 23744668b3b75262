"""Batched pixel steps for the memory and gpu backends (registered in batch_ops.py's BATCH_OPS): colour
(color_jitter) and erasing (cutout), each with per-sample parameters."""

from __future__ import annotations

import torch

from torchsprint.errors import UsageError


class Cutout:
    """Zero a size x size square centred uniformly in the image, clipped at the borders
    (DeVries & Taylor 2017, as in the CIFAR speedruns), with probability p per sample."""

    k = 3
    fixes_size = False

    def __init__(self, size: int = 8, p: float = 1.0, value: int = 0):
        self.size, self.p, self.value = int(size), float(p), int(value)

    def params(self, u, hs, ws):
        cy = torch.floor(u[:, 0] * hs.double()).long()
        cx = torch.floor(u[:, 1] * ws.double()).long()
        return {"cy": cy, "cx": cx, "on": u[:, 2] < self.p}, hs, ws

    def _mask(self, h, w, cy, cx, on, device):
        y0 = (cy - self.size // 2)[:, None, None]
        x0 = (cx - self.size // 2)[:, None, None]
        yy = torch.arange(h, device=device)[None, :, None]
        xx = torch.arange(w, device=device)[None, None, :]
        inside = (yy >= y0) & (yy < y0 + self.size) & (xx >= x0) & (xx < x0 + self.size) & on[:, None, None]
        return inside[:, None]  # (B, 1, H, W)

    def apply_one(self, img, p, i):
        m = self._mask(
            img.shape[-2],
            img.shape[-1],
            p["cy"][i : i + 1].to(img.device),
            p["cx"][i : i + 1].to(img.device),
            p["on"][i : i + 1].to(img.device),
            img.device,
        )[0]
        return img.masked_fill(m, self.value)

    def apply_batch(self, x, p):
        return x.masked_fill(self._mask(x.shape[-2], x.shape[-1], p["cy"], p["cx"], p["on"], x.device), self.value)


class ColorJitter:
    """Per-sample brightness, contrast and saturation factors in [1 - v, 1 + v], applied in that fixed
    order in float and rounded back to uint8 (torchvision picks a random order; hue is not supported)."""

    k = 3
    fixes_size = False

    def __init__(self, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0):
        if hue:
            raise UsageError(
                "color_jitter hue is not supported by the batched "
                "(memory/gpu) backends; set hue: 0 or use data.backend=cpu."
            )
        self.b, self.c, self.s = float(brightness), float(contrast), float(saturation)

    def params(self, u, hs, ws):
        f = lambda v, col: (1 - v) + u[:, col] * 2 * v  # noqa: E731
        return {"b": f(self.b, 0), "c": f(self.c, 1), "s": f(self.s, 2)}, hs, ws

    def apply_batch(self, x, p):
        y = x.float()
        dev = x.device
        y = y * p["b"].to(dev, torch.float32).view(-1, 1, 1, 1)
        if y.shape[1] == 3:
            gray = (0.299 * y[:, 0] + 0.587 * y[:, 1] + 0.114 * y[:, 2]).unsqueeze(1)
        else:
            gray = y
        mean = gray.mean(dim=(1, 2, 3), keepdim=True)
        c = p["c"].to(dev, torch.float32).view(-1, 1, 1, 1)
        y = (y * c + mean * (1 - c)).clamp_(0, 255)
        if y.shape[1] == 3:
            gray = (0.299 * y[:, 0] + 0.587 * y[:, 1] + 0.114 * y[:, 2]).unsqueeze(1)
            s = p["s"].to(dev, torch.float32).view(-1, 1, 1, 1)
            y = y * s + gray * (1 - s)
        return y.clamp_(0, 255).round_().to(torch.uint8)

    def apply_one(self, img, p, i):
        return self.apply_batch(img[None], {k: v[i : i + 1] for k, v in p.items()})[0]
