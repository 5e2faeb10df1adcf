"""Detection with ``@fxq.fx_wrap()``: a RetinaNet-style detector, trained, quantized, converted.

    python tutorials/fx_wrap_detection.py            # full settings (about 10 minutes, 2 cores)
    python tutorials/fx_wrap_detection.py --fast     # small settings (what the tests run; 3-4)

A detector's forward ends in Python that a graph cannot hold: anchors built
with loops over feature-map shapes, and a post-process that thresholds scores,
runs NMS and returns a different number of boxes per image. Here both are
methods decorated with ``@fxq.fx_wrap()``: each is one graph node that runs at
call time, so its ``self.training`` branch is taken per call. In training the
post-process returns the raw per-level outputs and the anchors for the loss;
in eval it returns per-image detections. ``forward`` itself stays traceable.

The task is synthetic but honest: 64x64 images with a noisy textured
background and 1-3 filled rectangles (8-28 px), reddish (class 0) or greenish
(class 1); the test images come from another seed.

1. train the float detector (IoU anchor assignment, focal loss, smooth-L1);
2. calibrate, then fine-tune with QAT using the same training loop;
3. convert to the integer model;

and print AP50, precision and recall of the float, QAT (VALIDATION state)
and integer models side by side, plus how many test images get exactly the
same detections from the integer model as from the QAT model (all of them:
VALIDATION is the integer computation).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import batched_nms, box_iou, clip_boxes_to_image, sigmoid_focal_loss

import fxq
from fxq.fx.tracer import call_wrapped_method
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig, default_qat_8bit_fake_quant_qconfig

SIZE = 64  # image side, pixels
NUM_CLASSES = 2
MAX_OBJECTS = 3
BBOX_CLIP = 4.135  # log(1000 / 16), as in torchvision


# -- data ---------------------------------------------------------------------------------
def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images (n, 3, 64, 64) in 0..1, boxes (n, 3, 4) as x1 y1 x2 y2 and labels (n, 3), -1 = none."""
    g = torch.Generator().manual_seed(seed)
    # background: a tinted grey level, smooth colour texture, pixel noise (added last)
    grey = 0.3 + 0.35 * torch.rand(n, 1, 1, 1, generator=g)
    base = grey + 0.06 * torch.randn(n, 3, 1, 1, generator=g)
    texture = F.interpolate(
        torch.randn(n, 3, 8, 8, generator=g), size=SIZE, mode="bilinear", align_corners=False
    )
    images = base + 0.12 * texture
    boxes = torch.zeros(n, MAX_OBJECTS, 4)
    labels = torch.full((n, MAX_OBJECTS), -1, dtype=torch.long)
    for i in range(n):
        placed = 0
        wanted = int(torch.randint(1, MAX_OBJECTS + 1, (1,), generator=g))
        for _ in range(20):  # rejection sampling: rectangles do not touch
            if placed == wanted:
                break
            w, h = (int(v) for v in torch.randint(8, 29, (2,), generator=g))
            x0 = int(torch.randint(0, SIZE - w + 1, (1,), generator=g))
            y0 = int(torch.randint(0, SIZE - h + 1, (1,), generator=g))
            box = torch.tensor([x0, y0, x0 + w, y0 + h], dtype=torch.float32)
            if placed and touches(box, boxes[i, :placed]):
                continue
            label = int(torch.randint(0, NUM_CLASSES, (1,), generator=g))
            colour = 0.05 + 0.3 * torch.rand(3, generator=g)  # dark shade jitter ...
            colour[label] = 0.55 + 0.4 * torch.rand(1, generator=g)  # ... red or green channel high
            images[i, :, y0 : y0 + h, x0 : x0 + w] = colour[:, None, None]
            boxes[i, placed], labels[i, placed] = box, label
            placed += 1
    images = images + 0.05 * torch.randn(images.shape, generator=g)
    return images.clamp(0.0, 1.0), boxes, labels


def touches(box: torch.Tensor, others: torch.Tensor) -> bool:
    """Does ``box`` overlap or touch any of ``others`` (x1 y1 x2 y2)?"""
    apart = (box[0] > others[:, 2]) | (others[:, 0] > box[2])
    apart |= (box[1] > others[:, 3]) | (others[:, 1] > box[3])
    return not bool(apart.all())


def normalize(images: torch.Tensor) -> torch.Tensor:
    return (images - 0.5) / 0.25


# -- model --------------------------------------------------------------------------------
def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class Head(nn.Module):
    """Shared across pyramid levels: fxq gives each call its own output fake quant."""

    def __init__(self, channels: int, outputs: int, prior: float | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.out = nn.Conv2d(channels, outputs, 3, padding=1)
        nn.init.normal_(self.out.weight, std=0.01)
        # RetinaNet's prior: start with every anchor scoring `prior`, so the loss is not swamped
        nn.init.constant_(self.out.bias, 0.0 if prior is None else -math.log((1 - prior) / prior))

    def forward(self, x):
        return self.out(F.relu(self.conv(x)))


def encode(gt: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Box regression targets (dx, dy, dw, dh) of boxes ``gt`` relative to ``anchors``."""
    aw, ah = anchors[..., 2] - anchors[..., 0], anchors[..., 3] - anchors[..., 1]
    gw, gh = gt[..., 2] - gt[..., 0], gt[..., 3] - gt[..., 1]
    dx = (gt[..., 0] + gt[..., 2] - anchors[..., 0] - anchors[..., 2]) / 2 / aw
    dy = (gt[..., 1] + gt[..., 3] - anchors[..., 1] - anchors[..., 3]) / 2 / ah
    return torch.stack([dx, dy, torch.log(gw / aw), torch.log(gh / ah)], -1)


def decode(deltas: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    aw, ah = anchors[..., 2] - anchors[..., 0], anchors[..., 3] - anchors[..., 1]
    cx = (anchors[..., 0] + anchors[..., 2]) / 2 + deltas[..., 0] * aw
    cy = (anchors[..., 1] + anchors[..., 3]) / 2 + deltas[..., 1] * ah
    w = aw * deltas[..., 2].clamp(max=BBOX_CLIP).exp()
    h = ah * deltas[..., 3].clamp(max=BBOX_CLIP).exp()
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def flatten_levels(cls: list[torch.Tensor], box: list[torch.Tensor], num_classes: int):
    """Per-level head outputs (N, A*C, H, W) -> (N, sum H*W*A, C), in anchor order (y, x, a)."""

    def flat(t: torch.Tensor, c: int) -> torch.Tensor:
        n, _, h, w = t.shape
        return t.reshape(n, -1, c, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, c)

    logits = torch.cat([flat(c, num_classes) for c in cls], 1)
    return logits, torch.cat([flat(b, 4) for b in box], 1)


class TinyRetinaNet(nn.Module):
    """Backbone, two pyramid levels (strides 8 and 16), shared heads, wrapped anchors and post-process."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.num_classes = NUM_CLASSES
        self.strides = (8, 16)
        self.anchor_sizes = ((10.0, 16.0), (22.0, 30.0))  # per level
        self.aspect_ratios = (0.5, 1.0, 2.0)  # height / width
        self.num_anchors = len(self.anchor_sizes[0]) * len(self.aspect_ratios)
        self.score_thresh, self.nms_thresh, self.pre_nms, self.detections = 0.05, 0.5, 200, 20
        self._anchor_cache: dict[tuple, torch.Tensor] = {}  # shared, filled at call time

        self.quant = fxq.QuantStub()
        self.stem = conv_bn_relu(3, 16, 2)  # 32x32
        self.stage1 = nn.Sequential(conv_bn_relu(16, 24, 2), conv_bn_relu(24, 24))  # 16x16
        self.stage2 = nn.Sequential(conv_bn_relu(24, 32, 2), conv_bn_relu(32, 32))  # 8x8, stride 8
        self.stage3 = nn.Sequential(conv_bn_relu(32, 48, 2), conv_bn_relu(48, 48))  # 4x4, stride 16
        self.lateral8 = nn.Conv2d(32, width, 1)
        self.lateral16 = nn.Conv2d(48, width, 1)
        self.smooth8 = conv_bn_relu(width, width)
        self.cls_head = Head(width, self.num_anchors * self.num_classes, prior=0.01)
        self.box_head = Head(width, self.num_anchors * 4)
        self.dequant = fxq.DeQuantStub()

    def forward(self, x):
        x = self.quant(x)
        c8 = self.stage2(self.stage1(self.stem(x)))
        c16 = self.stage3(c8)
        p16 = self.lateral16(c16)
        p8 = self.smooth8(self.lateral8(c8) + F.interpolate(p16, scale_factor=2.0, mode="nearest"))
        feats = [p8, p16]
        cls = [self.dequant(self.cls_head(f)) for f in feats]
        box = [self.dequant(self.box_head(f)) for f in feats]
        return self.postprocess(cls, box, self.anchors(feats))

    @fxq.fx_wrap()
    def anchors(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per level (H*W*A, 4) anchors in pixels; Python loops over the feature-map shape."""
        out = []
        for f, stride, sizes in zip(feats, self.strides, self.anchor_sizes):
            h, w = f.shape[-2:]
            key = (h, w, stride, sizes, self.aspect_ratios)
            if key not in self._anchor_cache:
                rows = []
                for y in range(h):
                    for x in range(w):
                        cx, cy = (x + 0.5) * stride, (y + 0.5) * stride
                        for size in sizes:
                            for ratio in self.aspect_ratios:
                                aw, ah = size / ratio**0.5, size * ratio**0.5
                                rows.append([cx - aw / 2, cy - ah / 2, cx + aw / 2, cy + ah / 2])
                self._anchor_cache[key] = torch.tensor(rows)
            out.append(self._anchor_cache[key])
        return out

    @fxq.fx_wrap()
    def postprocess(self, cls, box, anchors):
        if self.training:  # raw outputs for the loss
            return {"cls": cls, "box": box, "anchors": anchors}
        logits, deltas = flatten_levels(cls, box, self.num_classes)
        anchors = torch.cat(anchors)
        image_size = (self.strides[0] * cls[0].shape[-2], self.strides[0] * cls[0].shape[-1])
        results = []
        for scores, d in zip(logits.sigmoid().flatten(1), deltas):
            idx = torch.nonzero(scores > self.score_thresh).squeeze(1)
            scores, order = scores[idx].topk(min(self.pre_nms, idx.numel()))
            idx = idx[order]
            a, labels = idx // self.num_classes, idx % self.num_classes
            boxes = clip_boxes_to_image(decode(d[a], anchors[a]), image_size)
            keep = batched_nms(boxes, scores, labels, self.nms_thresh)[: self.detections]
            results.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
        return results


# -- training -----------------------------------------------------------------------------
def assign(anchors: torch.Tensor, gt_boxes: torch.Tensor, gt_labels: torch.Tensor):
    """IoU matching: an anchor is positive at IoU >= 0.5 with some box (and each box's best
    anchor is positive), negative below 0.4, ignored in between.

    Returns the class targets (N, A, C), the box targets (N, A, 4), and the positive and
    used (positive or negative) masks (N, A).
    """
    n = gt_boxes.shape[0]
    iou = box_iou(gt_boxes.reshape(-1, 4), anchors).reshape(n, MAX_OBJECTS, -1)
    iou[gt_labels < 0] = -1.0
    best, matched = iou.max(1)  # per anchor
    best_per_gt = iou.amax(2, keepdim=True)
    forced = ((iou == best_per_gt) & (gt_labels >= 0)[..., None]).any(1)
    pos = (best >= 0.5) | forced
    used = pos | (best < 0.4)
    gt = torch.gather(gt_boxes, 1, matched[..., None].expand(-1, -1, 4))
    labels = torch.gather(gt_labels, 1, matched)
    cls_target = F.one_hot(labels.clamp(min=0), NUM_CLASSES).float() * pos[..., None]
    return cls_target, encode(gt, anchors.expand_as(gt)), pos, used


def detection_loss(out: dict, gt_boxes: torch.Tensor, gt_labels: torch.Tensor) -> torch.Tensor:
    logits, deltas = flatten_levels(out["cls"], out["box"], NUM_CLASSES)
    cls_target, box_target, pos, used = assign(torch.cat(out["anchors"]), gt_boxes, gt_labels)
    num_pos = max(1, int(pos.sum()))
    cls_loss = sigmoid_focal_loss(logits[used], cls_target[used], reduction="sum")
    box_loss = F.smooth_l1_loss(deltas[pos], box_target[pos], beta=1 / 9, reduction="sum")
    return (cls_loss + box_loss) / num_pos


def train(model: nn.Module, data, epochs: int, lr: float, batch: int = 32) -> None:
    images, boxes, labels = data
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps = epochs * ((len(images) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.15)
    model.train()  # the wrapped post-process returns raw outputs
    for epoch in range(epochs):
        perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for i in range(0, len(images), batch):
            idx = perm[i : i + batch]
            loss = detection_loss(model(normalize(images[idx])), boxes[idx], labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        print(f"    epoch {epoch + 1}/{epochs}: loss {total / len(images):.4f}")


# -- evaluation ---------------------------------------------------------------------------
@torch.no_grad()
def detect(model: nn.Module, images: torch.Tensor, batch: int = 100) -> list[dict]:
    model.eval()
    return [
        d for i in range(0, len(images), batch) for d in model(normalize(images[i : i + batch]))
    ]


def match(det: dict, boxes: torch.Tensor, labels: torch.Tensor, iou_thresh: float = 0.5):
    """Greedy, highest score first: is each detection a true positive (same class, IoU >= 0.5
    with a not yet matched ground-truth box)?"""
    valid = labels >= 0
    gt_boxes, gt_labels = boxes[valid], labels[valid]
    iou = box_iou(det["boxes"], gt_boxes) if len(gt_boxes) else torch.zeros(len(det["boxes"]), 0)
    taken = torch.zeros(len(gt_boxes), dtype=torch.bool)
    tp = torch.zeros(len(det["boxes"]), dtype=torch.bool)
    for k in det["scores"].argsort(descending=True).tolist():
        cand = iou[k].masked_fill(taken | (gt_labels != det["labels"][k]), -1.0)
        if cand.numel() and cand.max() >= iou_thresh:
            taken[cand.argmax()] = True
            tp[k] = True
    return tp


def evaluate(dets: list[dict], data, score_thresh: float = 0.3) -> dict[str, float]:
    """AP50 (mean over classes, all-point interpolation) and precision / recall at
    score >= ``score_thresh``, in %."""
    _, boxes, labels = data
    scores, hits, classes = [], [], []
    for det, b, lab in zip(dets, boxes, labels):
        scores.append(det["scores"])
        hits.append(match(det, b, lab))
        classes.append(det["labels"])
    scores, hits, classes = torch.cat(scores), torch.cat(hits), torch.cat(classes)
    aps = []
    for c in range(NUM_CLASSES):
        n_gt = int((labels == c).sum())
        order = scores[classes == c].argsort(descending=True)
        tp = hits[classes == c][order].float().cumsum(0)
        recall = tp / max(n_gt, 1)
        precision = tp / torch.arange(1, len(tp) + 1)
        # precision envelope, then the area under the precision-recall curve
        envelope = precision.flip(0).cummax(0).values.flip(0)
        steps = torch.diff(recall, prepend=torch.zeros(1))
        aps.append(float((envelope * steps).sum()) if len(tp) else 0.0)
    kept = scores >= score_thresh
    return {
        "AP50": 100 * sum(aps) / len(aps),
        "precision": 100 * float(hits[kept].float().mean()) if kept.any() else 0.0,
        "recall": 100 * int(hits[kept].sum()) / int((labels >= 0).sum()),
    }


def identical(a: dict, b: dict) -> bool:
    return all(
        a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in ("boxes", "scores", "labels")
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="fxq detection tutorial with @fxq.fx_wrap()")
    parser.add_argument("--fast", action="store_true", help="fewer images and epochs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    n_train, epochs, qat_epochs = (1024, 8, 2) if args.fast else (2048, 12, 3)
    start = time.perf_counter()
    train_set = make_dataset(n_train, seed=0)
    test_set = make_dataset(400, seed=1)

    print("1. float training")
    model = TinyRetinaNet()
    train(model, train_set, epochs, lr=3e-3)

    print("2. calibration and QAT")
    fxq.set_march("bayes")
    calib = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(calib, fxq.FakeQuantState.CALIBRATION)
    detect(calib, train_set[0][:256])  # observers only; eval mode, so BatchNorm stays put
    qat = fxq.prepare_qat_fx(model, {"": default_qat_8bit_fake_quant_qconfig})
    qat.load_state_dict(calib.state_dict())
    wrapped = [n.args[1] for n in qat.graph.nodes if n.target is call_wrapped_method]
    shared = [n for n, _ in qat.named_children() if "_call" in n]
    print(f"    wrapped methods, one graph node each: {wrapped}")
    print(f"    shared heads, a QAT module per extra call: {shared}")
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)
    train(qat, train_set, qat_epochs, lr=3e-4)  # the same loop: training mode gives raw outputs
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)

    print("3. integer model")
    integer = fxq.convert_fx(qat)

    dets = {
        name: detect(m, test_set[0])
        for name, m in (("float", model), ("qat", qat), ("integer", integer))
    }
    metrics = {name: evaluate(d, test_set) for name, d in dets.items()}
    same = [identical(a, b) for a, b in zip(dets["integer"], dets["qat"])]
    results = {name: m["AP50"] for name, m in metrics.items()}
    for name, m in metrics.items():
        results[f"{name} precision"], results[f"{name} recall"] = m["precision"], m["recall"]
    results["integer = qat"] = 100.0 * sum(same) / len(same)

    print(f"{len(test_set[0])} held-out images, {int((test_set[2] >= 0).sum())} objects (%):")
    print(
        f"  {'':<19s}{'AP50':>7s}{'prec.':>7s}{'recall':>7s}   (IoU 0.5; prec./recall at score >= 0.3)"
    )
    for name, label in (("float", "float"), ("qat", "QAT (VALIDATION)"), ("integer", "integer")):
        m = metrics[name]
        print(f"  {label:<19s}{m['AP50']:7.1f}{m['precision']:7.1f}{m['recall']:7.1f}")
    count = sum(len(d["boxes"]) for d in dets["integer"])
    agree = results["integer = qat"]
    print(
        f"  integer detections identical to QAT (VALIDATION): {agree:.1f}% of images ({count} boxes)"
    )
    print(f"  total time {time.perf_counter() - start:.1f} s")
    return results


if __name__ == "__main__":
    main()
