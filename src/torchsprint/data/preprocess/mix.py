"""Mixup and CutMix on training batches after the loader (every backend), with soft targets.

Semantics follow torchvision.transforms.v2.MixUp / CutMix (the arithmetic, the pairing and the box)
and timm.data.Mixup (the switches: prob, switch_prob, mode):

- Pairing: sample i is mixed with sample i - 1 of the same batch (torchvision's `roll(1, 0)`; timm
  pairs i with B - 1 - i, `flip(0)`). The batch is already shuffled, so either is a random partner.
- Mixup: x = partner * (1 - lam) + x * lam, lam ~ Beta(mixup_alpha, mixup_alpha); the target is
  mixed with the same lam and the same operation order as torchvision (bit-identical given lam).
- CutMix: lam ~ Beta(cutmix_alpha, cutmix_alpha); box centre uniform over the pixels, half sides
  int(0.5 * sqrt(1 - lam) * W) and ... * H, clipped at the borders; the pasted area sets the target
  weight lam = 1 - box area / image area (torchvision's CutMix, timm's correct_lam=True). timm
  rounds the box slightly differently (int(W * sqrt(1 - lam)) // 2): at most one pixel per side.
- Both alphas > 0: CutMix with probability switch_prob, else Mixup (timm; torchvision's
  RandomChoice([CutMix, MixUp], p=[switch_prob, 1 - switch_prob])).
- prob: the chance that a batch (mode=batch) or a sample (mode=elem) is mixed at all (timm's
  mix_prob; torchvision always mixes). mode=elem draws lam, the switch and the box per sample (timm's
  elem mode; timm's `pair` mode is not offered).
- Label smoothing is the loss's (loss.label_smoothing): nn.CrossEntropyLoss smooths probability
  targets as (1 - eps) * t + eps / C, which equals timm's mixup_target (smoothing each one-hot, then
  mixing) because both are linear.

Randomness: batch b of epoch e on rank r draws from a NumPy PCG64 generator seeded with
core.sample_seed(run seed, e, MIX_INDEX + b * world_size + r): independent of the model's RNG stream,
of worker counts and of where a resumed run restarts (the loader wrapper counts batches from
set_epoch's start_batch), so a paused and resumed run mixes exactly as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torchsprint.data.core import sample_seed
from torchsprint.errors import UsageError

MIX_INDEX = 1 << 62  # offsets the batch counter away from sample indices (sample_seed's index argument)
SOFT_TARGET_LOSSES = ("cross_entropy", "bce_with_logits")  # built-in losses that take (B, C) probability targets


@dataclass
class MixParams:
    """Per-sample mixing parameters of one batch (CPU tensors of length B).

    use: whether the sample is mixed; cut: CutMix (else Mixup); lam: the image weight of the sample
    itself (Mixup) or the target weight after the box correction (CutMix); box: (B, 4) x1, y1, x2, y2.
    """

    use: torch.Tensor
    cut: torch.Tensor
    lam: torch.Tensor
    box: torch.Tensor


def cutmix_box(lam: np.ndarray, ry: np.ndarray, rx: np.ndarray, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's CutMix box for centres (ry, rx) and Beta draws `lam`: ((B, 4) x1, y1, x2, y2, corrected lam)."""
    r = 0.5 * np.sqrt(1.0 - lam)
    rw, rh = (r * w).astype(np.int64), (r * h).astype(np.int64)  # int(): truncation, as torchvision
    x1, y1 = np.maximum(rx - rw, 0), np.maximum(ry - rh, 0)
    x2, y2 = np.minimum(rx + rw, w), np.minimum(ry + rh, h)
    lam_adj = 1.0 - (x2 - x1) * (y2 - y1) / (w * h)
    return np.stack([x1, y1, x2, y2], 1), lam_adj


class Mixer:
    """Draws MixParams for a batch from a seed and applies them to (images, class indices).

    Args:
        mixup_alpha, cutmix_alpha: Beta parameters; 0 turns that kind off (at least one must be > 0).
        prob: chance a batch / sample is mixed; switch_prob: chance of CutMix when both are on.
        mode: "batch" (one draw per batch) or "elem" (one per sample).
        num_classes: width of the soft targets.
    """

    def __init__(
        self, mixup_alpha: float, cutmix_alpha: float, prob: float, switch_prob: float, mode: str, num_classes: int
    ):
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)
        self.prob, self.switch_prob, self.mode, self.num_classes = float(prob), float(switch_prob), mode, num_classes

    def draw(self, seed: int, n: int, h: int, w: int) -> MixParams:
        """Parameters for a batch of n images of h x w, from a PCG64 generator seeded with `seed`.

        Every draw is made whether it is used or not (a fixed count per batch), so that one setting never
        shifts the stream another reads.
        """
        g = np.random.Generator(np.random.PCG64(seed))
        m = n if self.mode == "elem" else 1
        u_use, u_switch = g.random(m), g.random(m)
        lam_mix = g.beta(self.mixup_alpha, self.mixup_alpha, m) if self.mixup_alpha > 0 else np.ones(m)
        lam_cut = g.beta(self.cutmix_alpha, self.cutmix_alpha, m) if self.cutmix_alpha > 0 else np.ones(m)
        ry, rx = g.integers(0, h, m), g.integers(0, w, m)  # torch.randint(H), torch.randint(W)
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cut = u_switch < self.switch_prob
        else:
            cut = np.full(m, self.cutmix_alpha > 0)
        box, lam_box = cutmix_box(lam_cut, ry, rx, h, w)
        lam = np.where(cut, lam_box, lam_mix)
        use = u_use < self.prob
        if m != n:
            use, cut, lam, box = (np.repeat(a, n, axis=0) for a in (use, cut, lam, box))
        return MixParams(
            torch.from_numpy(use),
            torch.from_numpy(cut),
            torch.from_numpy(lam.astype(np.float64)),
            torch.from_numpy(box.astype(np.int64)),
        )

    def apply(self, x: torch.Tensor, y: torch.Tensor, p: MixParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixed images, (B, num_classes) float32 soft targets). `x`: (B, ..., H, W) float, any device."""
        dev, b = x.device, x.shape[0]
        h, w = x.shape[-2:]
        lam = torch.where(p.use, p.lam, torch.ones_like(p.lam))  # an unmixed sample keeps itself with weight 1
        # The weight of the sample itself and of its partner, each rounded from float64 separately, as
        # torchvision's `roll(1, 0).mul_(1.0 - lam).add_(x.mul(lam))`: bit-identical given lam.
        shape = (b,) + (1,) * (x.ndim - 1)
        w_self, w_partner = lam.to(x.dtype).view(shape).to(dev), (1.0 - lam).to(x.dtype).view(shape).to(dev)
        cut = p.use & p.cut
        if bool(cut.any()):  # host values only (CPU parameters): no device sync
            # CutMix samples: weight 0 inside the box and 1 outside (the partner's pixels are pasted exactly).
            yy = torch.arange(h, device=dev)[None, :, None]
            xx = torch.arange(w, device=dev)[None, None, :]
            x1, y1, x2, y2 = (p.box[:, i, None, None].to(dev) for i in range(4))
            inside = (yy >= y1) & (yy < y2) & (xx >= x1) & (xx < x2)  # (B, H, W)
            pix = (b,) + (1,) * (x.ndim - 3) + (h, w)
            cut_d = cut.to(dev).view(shape)
            w_self = torch.where(cut_d, (~inside).view(pix).to(x.dtype), w_self)
            w_partner = torch.where(cut_d, inside.view(pix).to(x.dtype), w_partner)
        mixed = torch.add(x.roll(1, 0) * w_partner, x * w_self)
        if x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last):
            mixed = mixed.contiguous(memory_format=torch.channels_last)
        onehot = torch.nn.functional.one_hot(y, self.num_classes).float()
        t_self, t_partner = lam.float()[:, None].to(dev), (1.0 - lam).float()[:, None].to(dev)
        soft = torch.add(onehot.roll(1, 0) * t_partner, onehot * t_self)
        return mixed, soft


class MixLoader:
    """A training loader whose batches come out mixed: (images, soft targets) on the same device.

    It counts batches from set_epoch's start_batch, so the seed of every batch is the same in a
    resumed run as in an uninterrupted one.
    """

    def __init__(self, loader, mixer: Mixer, seed: int, rank: int = 0, world_size: int = 1):
        self.loader, self.mixer, self.seed, self.rank, self.world_size = loader, mixer, seed, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start = epoch, start_batch
        self.loader.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        return len(self.loader)

    def batch_seed(self, batch: int) -> int:
        return sample_seed(self.seed, self.epoch, MIX_INDEX + batch * self.world_size + self.rank)

    def __iter__(self):
        for b, (x, y) in enumerate(self.loader, start=self.start):
            p = self.mixer.draw(self.batch_seed(b), x.shape[0], x.shape[-2], x.shape[-1])
            yield self.mixer.apply(x, y, p)

    def __getattr__(self, name):  # skipped-sample lists and other backend attributes
        return getattr(self.loader, name)


def check_mix(mix_cfg, task: str, targets: str, loss_cfg) -> bool:
    """Whether mixing is on; refuses settings that would be ignored and tasks/losses it cannot serve.

    Args:
        mix_cfg: the `mix` section; task: the task name; targets: the task's kind of targets
            (tasks.Task.targets); loss_cfg: the `loss` section (the soft targets must reach a loss that takes them).
    """
    on = mix_cfg.mixup_alpha > 0 or mix_cfg.cutmix_alpha > 0
    defaults = {k: f.default for k, f in type(mix_cfg).model_fields.items()}
    if not on:
        set_ = [
            f"mix.{k}={getattr(mix_cfg, k)}"
            for k in ("prob", "switch_prob", "mode")
            if getattr(mix_cfg, k) != defaults[k]
        ]
        if set_:
            raise UsageError(
                f"{', '.join(set_)}: mixing is off (mix.mixup_alpha and mix.cutmix_alpha are 0). Set "
                "mix.mixup_alpha and/or mix.cutmix_alpha > 0 (e.g. 0.2 and 1.0), or remove it."
            )
        return False
    if mix_cfg.switch_prob != defaults["switch_prob"] and not (mix_cfg.mixup_alpha > 0 and mix_cfg.cutmix_alpha > 0):
        raise UsageError(
            f"mix.switch_prob={mix_cfg.switch_prob} chooses between CutMix and Mixup, but only "
            f"{'CutMix' if mix_cfg.cutmix_alpha > 0 else 'Mixup'} is on. Set both alphas > 0, or remove it."
        )
    if targets != "class_index":
        raise UsageError(
            f"mix (Mixup/CutMix) mixes one class per image into soft class targets; task={task} has "
            f"{targets} targets, where it has no defined meaning here. Remove the mix section."
        )
    names = [t.name for t in loss_cfg.terms] if loss_cfg.terms else [loss_cfg.name]
    bad = [n for n in names if n not in SOFT_TARGET_LOSSES]
    if bad:
        raise UsageError(
            f"mix: loss {bad[0]} may not take the (batch, classes) soft targets Mixup/CutMix produce; use "
            f"loss.name={' or '.join(SOFT_TARGET_LOSSES)}, or remove the mix section."
        )
    args = [loss_cfg.args] + [t.args for t in loss_cfg.terms]
    if any("ignore_index" in a for a in args):
        raise UsageError(
            "mix: loss.args.ignore_index has no meaning for soft targets (PyTorch ignores it for them); "
            "remove it or the mix section."
        )
    return True


def wrap_mix(loader, mix_cfg, num_classes: int, seed: int, rank: int, world_size: int):
    """The training loader with Mixup/CutMix applied (call check_mix first: it must be on)."""
    mixer = Mixer(
        mix_cfg.mixup_alpha, mix_cfg.cutmix_alpha, mix_cfg.prob, mix_cfg.switch_prob, mix_cfg.mode, num_classes
    )
    return MixLoader(loader, mixer, seed, rank, world_size)


__all__ = ["Mixer", "MixParams", "MixLoader", "check_mix", "wrap_mix", "cutmix_box"]
