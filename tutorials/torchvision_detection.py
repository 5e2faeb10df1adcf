"""Quantizing torchvision detection models you cannot edit.

    python tutorials/torchvision_detection.py          # both models, full proposal counts
    python tutorials/torchvision_detection.py --fast   # fewer proposals (what the tests run)

``fasterrcnn_mobilenet_v3_large_320_fpn`` and ``ssdlite320_mobilenet_v3_large``
take a list of images, resize them, generate anchors and run NMS: Python a
graph cannot hold, in a package you cannot edit. A small wrapper module (the
"user code" below, about 20 lines per model) keeps the backbone, the FPN and
the SSD head in the traced graph (fused and integer) and puts everything
else in two ``@fxq.fx_wrap()`` methods that run at call time:

* ``preprocess``: torchvision's resize and normalisation (float);
* ``postprocess``: anchors, box decoding and NMS (float). The layers these
  call, the RPN head and the RoI box head and predictor of Faster R-CNN, are
  quantized too: fxq swaps every module that wrapped code calls for a
  standalone QAT module, and converts it to its integer twin.

Weights are random (no download); the images are photos from
``skimage.data``. The script prints how many layers are integer in each
part, and checks that the integer model's detections are identical to the
QAT model's in VALIDATION state (VALIDATION is the integer computation).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor, nn
from torchvision.models import detection

import fxq
from fxq import registry
from fxq.quantized.base import QuantizedModule, Standalone


# -- user code: Faster R-CNN ---------------------------------------------------------
class QuantizableFasterRCNN(nn.Module):
    """Backbone + FPN traced; resize, RPN (anchors, NMS) and RoI heads wrapped."""

    def __init__(self, model: detection.FasterRCNN) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> list[dict[str, Tensor]]:
        batch = self.preprocess(images)
        features = self.model.backbone(batch.tensors)
        return self.postprocess(images, batch, features)

    @fxq.fx_wrap()
    def preprocess(self, images: Tensor):
        return self.model.transform(list(images))[0]

    @fxq.fx_wrap()
    def postprocess(self, images: Tensor, batch, features: dict[str, Tensor]) -> list[dict]:
        proposals, _ = self.model.rpn(batch, features)
        found, _ = self.model.roi_heads(features, proposals, batch.image_sizes)
        sizes = [tuple(image.shape[-2:]) for image in images]
        return self.model.transform.postprocess(found, batch.image_sizes, sizes)


# -- user code: SSDlite --------------------------------------------------------------
class QuantizableSSD(nn.Module):
    """Backbone and head traced; resize, anchors and NMS wrapped."""

    def __init__(self, model: detection.SSD) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> list[dict[str, Tensor]]:
        batch = self.preprocess(images)
        features = list(self.model.backbone(batch.tensors).values())
        return self.postprocess(images, batch, features, self.model.head(features))

    @fxq.fx_wrap()
    def preprocess(self, images: Tensor):
        return self.model.transform(list(images))[0]

    @fxq.fx_wrap()
    def postprocess(self, images, batch, features, head_outputs) -> list[dict]:
        anchors = self.model.anchor_generator(batch, features)
        found = self.model.postprocess_detections(head_outputs, anchors, batch.image_sizes)
        sizes = [tuple(image.shape[-2:]) for image in images]
        return self.model.transform.postprocess(found, batch.image_sizes, sizes)


# -- the tutorial ----------------------------------------------------------------------
def photos(side: int) -> list[Tensor]:
    """Three photos from skimage.data as (3, side, side) floats in 0..1."""
    from skimage import data

    images = []
    for load in (data.astronaut, data.coffee, data.chelsea):
        image = torch.from_numpy(load().copy()).permute(2, 0, 1).float().div(255)
        images.append(nn.functional.interpolate(image[None], size=(side, side))[0])
    return images


def build(name: str, fast: bool) -> nn.Module:
    """A detection model with random weights; score thresholds low enough to keep boxes."""
    torch.manual_seed(0)
    common = {"weights": None, "weights_backbone": None, "num_classes": 3}
    if name == "fasterrcnn":
        proposals = {"rpn_pre_nms_top_n_test": 64, "rpn_post_nms_top_n_test": 32} if fast else {}
        model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            **common, box_score_thresh=0.0, box_detections_per_img=20, **proposals
        )
        if fast:  # smaller images: a quarter of the compute
            model.transform.min_size, model.transform.max_size = (160,), 160
        return QuantizableFasterRCNN(model.eval())
    model = detection.ssdlite320_mobilenet_v3_large(
        **common, score_thresh=0.0, detections_per_img=20, topk_candidates=50 if fast else 300
    )
    if fast:
        model.transform.fixed_size = (160, 160)
    return QuantizableSSD(model.eval())


def integer_share(model: nn.Module, prefixes: dict[str, str]) -> dict[str, str]:
    """'integer layers / layers with weights' (conv, linear, BN) under each path prefix."""
    weighted = [row for row in registry.ROWS if row.kind is registry.Kind.WEIGHTED and row.integer]
    integer_classes = tuple(row.integer_class for row in weighted)
    float_classes = tuple(m for row in weighted for m in row.modules)
    report = {}
    for part, prefix in prefixes.items():
        integer = total = 0
        stack = [model.get_submodule(prefix)]
        while stack:
            module = stack.pop()
            if getattr(module, "_fxq_absorbed", False):
                continue  # fused into the conv before it
            if isinstance(module, integer_classes):
                integer, total = integer + 1, total + 1
            elif isinstance(module, float_classes):
                total += 1
            elif not isinstance(module, QuantizedModule) or isinstance(module, Standalone):
                stack.extend(module.children())  # a Standalone wraps the integer layer
        report[part] = f"{integer}/{total}"
    return report


PARTS = {
    "fasterrcnn": {
        "backbone": "model.backbone.body",
        "fpn": "model.backbone.fpn",
        "rpn head": "model.rpn.head",
        "box head": "model.roi_heads.box_head",
        "box predictor": "model.roi_heads.box_predictor",
    },
    "ssdlite": {"backbone": "model.backbone", "head": "model.head"},
}


def same_detections(a: list[dict], b: list[dict]) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("boxes", "scores", "labels"))


def run(name: str, fast: bool) -> dict[str, object]:
    fxq.set_march("bayes")
    model = build(name, fast)
    images = torch.stack(photos(320))
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_calib_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        float_dets = model(images)
        qat(images)
        fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
        validation = qat(images)
        integer = fxq.convert_fx(qat)
        integer_dets = integer(images)
    boxes = sum(len(d["boxes"]) for d in integer_dets)
    float_boxes = sum(len(d["boxes"]) for d in float_dets)
    return {
        "layers": integer_share(integer, PARTS[name]),
        "boxes": boxes,
        "float boxes": float_boxes,
        "identical": same_detections(validation, integer_dets),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, object]]:
    parser = argparse.ArgumentParser(description="fxq: quantize torchvision detection models")
    parser.add_argument("--fast", action="store_true", help="fewer proposals and candidates")
    args = parser.parse_args(argv)
    results = {}
    for name in ("fasterrcnn", "ssdlite"):
        start = time.perf_counter()
        results[name] = r = run(name, args.fast)
        print(f"{name}: integer layers (integer/with weights) {r['layers']}")
        print(
            f"  {r['boxes']} integer detections on 3 photos ({r['float boxes']} float); identical "
            f"to QAT (VALIDATION): {r['identical']}; {time.perf_counter() - start:.1f} s"
        )
    return results


if __name__ == "__main__":
    main()
