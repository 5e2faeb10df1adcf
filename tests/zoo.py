"""A model that uses every op fxq quantizes, in module and functional forms."""

import torch
import torch.nn.functional as F
from torch import nn


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, padding_mode="reflect")
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2, groups=2)
        self.up_bn = nn.BatchNorm2d(8)
        self.bn_alone = nn.BatchNorm2d(8)
        self.c1d = nn.Conv1d(8, 4, 3, padding=1)
        self.c3d = nn.Conv3d(1, 2, 3, padding=1)
        self.pool = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.apool = nn.AdaptiveAvgPool2d((3, 5))
        self.mpool = nn.MaxPool2d(2)
        self.act6 = nn.ReLU6()
        self.hsw = nn.Hardswish()
        self.sig = nn.Sigmoid()
        self.gelu = nn.GELU()
        self.lrelu = nn.LeakyReLU(0.1)
        self.upsample = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.fc = nn.Linear(8 * 3 * 5, 16)
        self.fc_bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))  # conv+bn+relu
        z = self.dw(y) + y  # conv+add (reflect padding)
        z = self.act6(self.bn_alone(z))  # standalone bn, standalone relu6
        u = F.relu(self.up_bn(self.up(z)))  # grouped convtranspose+bn+relu
        u = self.mpool(u)  # max pooling keeps the scale
        a = self.hsw(z) * self.sig(u)  # LUTs and a product
        a = a - 0.25 * z  # scalar mul, sub
        a = torch.cat(
            [a, F.interpolate(self.pool(z), size=z.shape[-2:], mode="nearest")], 1
        )  # avg pool, cat
        a = a[:, ::2] + 1.0  # slicing, scalar add
        b = F.interpolate(self.gelu(a), scale_factor=0.5, mode="bilinear", align_corners=False)
        b = self.upsample(b)
        b = F.hardtanh(self.lrelu(b), -0.5, 2.0) + torch.clamp(b, -1.0, 1.0)
        s = torch.tanh(b).mean(dim=(2, 3))  # [N, 8]
        t = self.c1d(s.unsqueeze(-1).expand(-1, -1, 6)).sum(-1, keepdim=True)  # conv1d, sum
        v = self.c3d(b[:, :1].unsqueeze(1)).flatten(1, 2)  # conv3d
        m = torch.matmul(b.flatten(2), b.flatten(2).transpose(1, 2))  # matmul of activations
        f = torch.flatten(self.apool(b), 1)  # non-divisible adaptive pooling
        f = F.relu(self.fc_bn(self.fc(f)))  # linear+bn1d+relu
        out = (
            self.head(f) + torch.exp(-F.silu(t.squeeze(-1)))[:, :1] + v.mean((1, 2, 3)).unsqueeze(1)
        )
        return out, m.sum((1, 2))
