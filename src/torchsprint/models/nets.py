"""Built-in nets for small images: a fast small CNN and a CIFAR-style ResNet-18 (3x3 stem, no max-pool)."""

from __future__ import annotations

import torch
from torch import nn

from torchsprint.models.core import MODELS, FramesFirst


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


@MODELS.register("small_cnn")
def small_cnn(num_classes: int, in_channels: int = 3, width: int = 32, dropout: float = 0.0) -> nn.Module:
    """Three conv-BN-ReLU blocks (width, 2x, 4x), one 2x2 max-pool, global average pool, linear head.

    ~100k parameters at width 32; any input size >= 2x2.
    """
    w = width
    return nn.Sequential(
        conv_bn(in_channels, w),
        conv_bn(w, 2 * w),
        nn.MaxPool2d(2),
        conv_bn(2 * w, 4 * w),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout) if dropout > 0 else nn.Identity(),
        nn.Linear(4 * w, num_classes),
    )


@MODELS.register("linear")
def linear(num_classes: int, in_channels: int = 3, in_features: int | None = None) -> nn.Module:
    """Flatten + one linear layer (LazyLinear infers the input size on the first batch)."""
    layer = nn.Linear(in_features, num_classes) if in_features else nn.LazyLinear(num_classes)
    return nn.Sequential(nn.Flatten(), layer)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet with a 3x3 stride-1 stem and no max-pool (He et al. 2016, section 4.2), for 32x32 inputs."""

    def __init__(self, blocks=(2, 2, 2, 2), num_classes: int = 10, in_channels: int = 3, width: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.relu(self.bn1(self.conv1(x))))
        return self.fc(self.pool(x).flatten(1))


@MODELS.register("cifar_resnet18")
def cifar_resnet18(num_classes: int, in_channels: int = 3, width: int = 64) -> nn.Module:
    """CIFAR-style ResNet-18: 11M parameters at width 64."""
    return CifarResNet((2, 2, 2, 2), num_classes, in_channels, width)


class ShallowUNet(nn.Module):
    """A two-level U-Net for image restoration: (N, C_in, H, W) -> (N, C_out, H, W), same units as the target.

    conv-conv at full resolution, conv-conv at half (stride-2 down, bilinear up), skip concatenation,
    a 1x1 head. When C_in == C_out the head predicts a residual added to the input (Zhang et al. 2017,
    DnCNN): a restoration net starts as the identity, so it begins at the input's quality and learns
    the correction. Any H, W (odd sizes are padded for the down/up path and cropped back).
    """

    def __init__(self, in_channels: int, out_channels: int, width: int = 16, residual: bool = True):
        super().__init__()
        w = width

        def block(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, 1, 1), nn.LeakyReLU(0.1), nn.Conv2d(cout, cout, 3, 1, 1), nn.LeakyReLU(0.1)
            )

        self.enc = block(in_channels, w)
        self.down = nn.Sequential(nn.Conv2d(w, 2 * w, 3, 2, 1), nn.LeakyReLU(0.1), block(2 * w, 2 * w))
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec = block(3 * w, w)
        self.head = nn.Conv2d(w, out_channels, 1)
        self.residual = residual and in_channels == out_channels
        if self.residual:  # start near the identity map: a small correction (zero would stall the layers below)
            with torch.no_grad():
                self.head.weight.mul_(0.1)
                self.head.bias.zero_()

    def forward(self, x):
        h, w = x.shape[-2:]
        e = self.enc(x)
        d = self.up(self.down(e))[..., :h, :w]
        y = self.head(self.dec(torch.cat([e, d], dim=1)))
        return x + y if self.residual else y


@MODELS.register("unet_small")
def unet_small(num_classes: int, in_channels: int = 3, width: int = 16, residual: bool = True) -> nn.Module:
    """Shallow U-Net for task=image_to_image: `num_classes` is the number of output channels (the dataset's).

    ~30k parameters at width 16 (two resolutions, one skip); see ShallowUNet.
    """
    return ShallowUNet(in_channels, num_classes, width, residual)


@MODELS.register("small_3d_cnn")
def small_3d_cnn(num_classes: int, in_channels: int = 3, width: int = 16) -> nn.Module:
    """task=video: two 3x3x3 conv-BN-ReLU blocks (the second strided in time and space), global pool, linear head.

    Input (N, T, C, H, W) clips; ~20k parameters at width 16; for CPU tests and tiny clips.
    """
    w = width
    net = nn.Sequential(
        nn.Conv3d(in_channels, w, 3, 1, 1, bias=False),
        nn.BatchNorm3d(w),
        nn.ReLU(inplace=True),
        nn.Conv3d(w, 2 * w, 3, 2, 1, bias=False),
        nn.BatchNorm3d(2 * w),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(2 * w, num_classes),
    )
    return FramesFirst(net)


class _ConvGroup(nn.Sequential):
    """airbench's block: conv 3x3 -> 2x2 max-pool -> BN -> GELU -> conv 3x3 -> BN -> GELU."""

    def __init__(self, cin: int, cout: int, bn_momentum: float):
        def bn(c):
            return nn.BatchNorm2d(c, momentum=bn_momentum, eps=1e-12)

        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.MaxPool2d(2),
            bn(cout),
            nn.GELU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            bn(cout),
            nn.GELU(),
        )


class _Scale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


@MODELS.register("airbench_net")
def airbench_net(
    num_classes: int, in_channels: int = 3, widths: tuple[int, int, int] = (64, 256, 256), bn_momentum: float = 0.4
) -> nn.Module:
    """The network of Keller Jordan's airbench94 (CIFAR-10 to 94% in a few seconds on an A100), for 32x32 inputs.

    A 2x2 stem conv (24 channels), three conv groups (see _ConvGroup) at `widths`, a 3x3 max-pool, a
    bias-free linear head scaled by 1/9. Differences from airbench94, said plainly: the stem is
    initialised randomly, not by patch whitening from the training images, and is trained like every
    layer; the BatchNorm weights train (airbench freezes them); no Dirac initialisation; and the training
    tricks around the net (Lookahead, flip-and-translate test-time augmentation, its own LR schedule) are
    not reproduced (configs/recipes/cifar10_airbench.yaml says which torchsprint settings stand in).
    """
    a, b, c = widths
    return nn.Sequential(
        nn.Conv2d(in_channels, 24, 2, bias=True),
        nn.GELU(),
        _ConvGroup(24, a, bn_momentum),
        _ConvGroup(a, b, bn_momentum),
        _ConvGroup(b, c, bn_momentum),
        nn.MaxPool2d(3),
        nn.Flatten(),
        nn.Linear(c, num_classes, bias=False),
        _Scale(1 / 9),
    )
