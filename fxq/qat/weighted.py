"""Ops with weights: conv, transposed conv, linear, each optionally fused with
BatchNorm, a residual add and ReLU/ReLU6.

The math, per forward:

* BatchNorm is folded into the weight with the *running* statistics,
  ``w' = w * gamma / sqrt(running_var + eps)``, and ``w'`` is fake-quantized
  per output channel: the weight the integer model will hold.
* While BatchNorm statistics train (``self.training`` and not frozen), the
  conv output is unfolded (divided by the same factor) and passed through
  the BatchNorm in training mode, so statistics keep updating and the
  gradient sees batch normalisation (the folding scheme of Jacob et al. /
  Krishnamoorthi 2018, as in torch.ao).
* Otherwise (eval, frozen statistics, VALIDATION) the folded bias
  ``beta + (b - running_mean) * gamma / std`` is fake-quantized to int32 at
  ``input_scale * weight_scale`` and the op runs once, as deployed.
* A residual is added before the activation; the output fake quant follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fxq.fake_quantize import FakeQuantState, fold_qat_forward
from fxq.fused import ACTIVATIONS, Fused
from fxq.qat.base import QATModule, activate, quantize_bias
from fxq.qconfig import QConfig
from fxq.quantized.functional import swap_group_axes

__all__ = ["WeightedQAT", "swap_group_axes", "batchnorm_factor", "batchnorm_std"]


def batchnorm_std(bn: nn.Module) -> Tensor:
    """``sqrt(running_var + eps)`` per channel.

    In a compiled graph it comes out of one opaque op, which the compiler's partitioner
    saves for the backward pass rather than recomputes. Recomputed there from
    ``running_var``, it would read the statistics the BatchNorm has updated in place by
    then (torch 2.14, pytorch/pytorch#197039): the first layer's folded BatchNorm weight of a
    small CNN got a gradient 3.4 % off eager's under inductor, and with inductor's
    decompositions and partitioner alone a step raised a version-counter error.
    """
    if torch.compiler.is_compiling():
        return _batchnorm_std_op(bn.running_var, float(bn.eps))
    return _std(bn.running_var, bn.eps)


def _std(running_var: Tensor, eps: float) -> Tensor:
    return torch.sqrt(running_var + eps)


@torch.library.custom_op("fxq::batchnorm_std", mutates_args=())
def _batchnorm_std_op(running_var: Tensor, eps: float) -> Tensor:
    """``batchnorm_std`` as one node of a compiled graph."""
    return _std(running_var, eps)


@_batchnorm_std_op.register_fake
def _(running_var, eps):
    return torch.empty_like(running_var)


def batchnorm_factor(bn: nn.Module) -> Tensor:
    """``gamma / sqrt(running_var + eps)`` per channel (``1 / std`` without affine)."""
    std = batchnorm_std(bn)
    return bn.weight / std if bn.weight is not None else 1.0 / std


def _scale_rows(w: Tensor, factor: Tensor) -> Tensor:
    """``w`` (out-major) with each output channel multiplied by its ``factor``."""
    return w * factor.reshape([-1] + [1] * (w.dim() - 1))


class WeightedQAT(QATModule):
    """Shared implementation of fxq.qat conv / transposed conv / linear.

    Subclasses set ``_FLOAT`` (the float classes they replace) and implement
    ``float_op_forward`` (the float op), ``_out_axis`` and the out-major weight view.

    Args:
        float_op: the float conv / linear module (its parameters are taken over).
        qconfig: the resolved QConfig.
        bn: a BatchNorm to fold, or None.
        activation: ``"relu"``, ``"relu6"`` or None.
        add: whether a residual is added before the activation.
        dropout: an ``nn.Dropout`` applied to the op's output before the residual add
            (training only: the integer model, like any model in eval mode, skips it).
    """

    _FLOAT: tuple[type[nn.Module], ...] = ()
    #: axis of the output channel in the op's output
    _out_axis = 1

    def __init__(
        self,
        float_op: nn.Module,
        qconfig: QConfig,
        bn: nn.Module | None = None,
        activation: str | None = None,
        add: bool = False,
        dropout: nn.Module | None = None,
    ) -> None:
        super().__init__(qconfig)
        self._copy_hyperparameters(float_op)
        self.weight = float_op.weight
        self.bias = float_op.bias
        if bn is not None and (bn.running_var is None or bn.running_mean is None):
            raise ValueError(
                f"cannot fold {type(bn).__name__} without running statistics (track_running_stats=False)"
            )
        self.bn = bn
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        self.activation = activation
        self.add = add
        self.dropout = dropout
        # a per-output-channel factor on the fused residual (``y = op(x) + g * residual``),
        # set by ``fxq.calibration.smooth_activations`` when the residual's producer divided
        # its channels by ``g``; None (no buffer, nothing in the state dict) until then
        self.register_buffer("residual_factor", None)
        self.freeze_bn = False
        self.weight_fake_quant = qconfig.weight(ch_axis=0, num_channels=self.out_channels)

    @classmethod
    def from_float(cls, module: nn.Module, qconfig: QConfig) -> WeightedQAT:
        """Build from a float op or a ``Fused`` chain around one."""
        if isinstance(module, Fused):
            return cls(
                module.op,
                qconfig,
                bn=module.bn,
                activation=module.activation,
                add=module.add,
                dropout=module.dropout,
            )
        return cls(module, qconfig)

    def to_float(self) -> nn.Module:
        """The float module this QAT module replaced (sharing its parameters)."""
        op = self._float_op()
        if self.bn is None and self.activation is None and not self.add:
            return op
        pattern = "_".join(
            [self._PATTERN_ANCHOR]
            + (["bn"] if self.bn is not None else [])
            + (["add"] if self.add else [])
            + ([self.activation] if self.activation else [])
        )
        return Fused(
            op,
            bn=self.bn,
            activation=self.activation,
            add=self.add,
            pattern=pattern,
            dropout=self.dropout,
            residual_factor=self.residual_factor,
        )

    _PATTERN_ANCHOR = "conv"

    def _float_op(self) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        # a recipe may have given a bias-free layer a bias (bias correction, learned rounding):
        # a freshly prepared model takes it, as a zero bias the load then fills
        if self.bias is None and isinstance(state_dict.get(prefix + "bias"), Tensor):
            weight = self.weight
            self.bias = nn.Parameter(
                torch.zeros(self.out_channels, dtype=weight.dtype, device=weight.device)
            )
        factor = state_dict.get(prefix + "residual_factor")
        if self.residual_factor is None and isinstance(factor, Tensor):
            self.set_residual_factor(torch.ones_like(factor, device=self.weight.device))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )

    def set_residual_factor(self, factor: Tensor) -> None:
        """Scale the fused residual per output channel: ``y = op(x) + factor * residual``.

        Raises:
            ValueError: the module has no fused add, or ``factor`` is not one positive finite
                value per output channel.
        """
        if not self.add:
            raise ValueError(f"{type(self).__name__} {self.name!r} has no fused residual add")
        factor = factor.detach().reshape(-1)
        if factor.numel() != self.out_channels or not bool(
            ((factor > 0) & torch.isfinite(factor)).all()
        ):
            raise ValueError(
                f"{type(self).__name__} {self.name!r}: a residual factor needs "
                f"{self.out_channels} positive finite values, got {factor.numel()}"
            )
        self.residual_factor = factor.to(device=self.weight.device, dtype=torch.float32)

    # -- subclass hooks ------------------------------------------------------------
    def _copy_hyperparameters(self, float_op: nn.Module) -> None:  # pragma: no cover
        raise NotImplementedError

    @property
    def out_channels(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def float_op_forward(
        self, x: Tensor, weight: Tensor, bias: Tensor | None
    ) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def weight_to_out_major(self, w: Tensor) -> Tensor:
        """View the weight with output channels on axis 0 (identity for conv / linear)."""
        return w

    def weight_from_out_major(self, w: Tensor) -> Tensor:
        return w

    # -- folding -----------------------------------------------------------------
    def _channel_shape(self, ndim: int) -> list[int]:
        shape = [1] * ndim
        shape[self._out_axis % ndim] = -1
        return shape

    def bn_factor(self) -> Tensor | None:
        """``gamma / sqrt(running_var + eps)`` per output channel, or None without BN."""
        return None if self.bn is None else batchnorm_factor(self.bn)

    def folded_weight(self, factor: Tensor | None = None) -> Tensor:
        """The BN-folded float weight in out-major layout (before fake quant); ``factor``:
        ``bn_factor()`` where the caller has it already."""
        return self._fold_weight(self.bn_factor() if factor is None else factor)

    def _fold_weight(self, factor: Tensor | None) -> Tensor:
        w = self.weight_to_out_major(self.weight)
        return w if factor is None else _scale_rows(w, factor)

    def folded_bias(self, factor: Tensor | None = None) -> Tensor | None:
        """The BN-folded float bias (None when there is neither bias nor BN); ``factor``:
        ``bn_factor()`` where the caller has it already."""
        bn = self.bn
        if bn is None:
            return self.bias
        if factor is None:
            factor = self.bn_factor()
        if self.bias is None and bn.bias is not None:  # ``beta + (0 - mean) * factor``
            return bn.bias - bn.running_mean * factor  # in two ops fewer
        b = self.bias if self.bias is not None else torch.zeros_like(bn.running_mean)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
        return beta + (b - bn.running_mean) * factor

    def quantized_weight(self, factor: Tensor | None = None) -> Tensor:
        """Fake-quantized folded weight in the op's layout (observes in CALIBRATION / QAT);
        ``factor``: as ``folded_weight``'s."""
        return self.weight_from_out_major(self.weight_fake_quant(self.folded_weight(factor)))

    def _bn_statistics_train(self) -> bool:
        return (
            self.bn is not None
            and self.training
            and not self.freeze_bn
            and self.state is not FakeQuantState.VALIDATION
        )

    # -- forward -------------------------------------------------------------------
    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if self.validating():
            return self.run_validation(x) if residual is None else self.run_validation(x, residual)
        if self.standalone:
            inputs = [x] if residual is None else [x, residual]
            quantized = self.quantize_standalone_inputs(inputs)
            x = quantized[0]
            residual = quantized[1] if residual is not None else None
        if self.add and residual is None:
            raise ValueError(f"{type(self).__name__} fused with add needs a residual input")
        if self._bn_statistics_train():
            # BatchNorm trains on batch statistics: the conv runs with the weight folded with
            # the running statistics (what deployment uses), then is unfolded for the BatchNorm.
            # The fold and the unfold cancel, so the folding factor is a constant here and the
            # BatchNorm's affine parameters get their gradient through the BatchNorm alone.
            # A channel whose factor is 0 (gamma = 0, timm's zero_init_last) or too small to
            # invert folds with 1 instead: the BatchNorm still sees the conv's true output (its
            # statistics and gamma's gradient stay right) and outputs beta there, as the folded
            # weight of 0 does at deployment.
            # On CUDA the fold and the weight's fake quant are one launch (``fold_qat_forward``,
            # the same bits as the torch ops below, which run wherever it does not apply).
            w = self.weight_to_out_major(self.weight)
            fused = fold_qat_forward(self.weight_fake_quant, w, self.bn)
            if fused is None:
                factor = self.bn_factor().detach()
                inverse = factor.reciprocal()  # ``1.0 / factor`` would add a product by 1
                # not isfinite, in two kernels instead of four; ``masked_fill`` with a number
                # makes no scalar tensor per call, as ``where`` does
                singular = (inverse - inverse) != 0
                factor = factor.masked_fill(singular, 1.0)
                inverse = inverse.masked_fill(singular, 1.0)
                w_q = self.weight_fake_quant(_scale_rows(w, factor))
            else:
                w_q, inverse = fused
            y = self.float_op_forward(x, self.weight_from_out_major(w_q), None)
            shape = self._channel_shape(y.dim())
            y = y * inverse.reshape(shape)
            if self.bias is not None:
                y = y + self.bias.reshape(shape)
            y = self.bn(y)
        else:
            factor = self.bn_factor()  # once for the weight and the bias
            w_q = self.quantized_weight(factor)
            b = self.folded_bias(factor)
            if b is not None:
                b = quantize_bias(
                    b, self.input_scale(0), self.weight_fake_quant.scale, self.state, self.march
                )
            y = self.float_op_forward(x, w_q, b)
        if self.dropout is not None:
            y = self.dropout(y)
        if self.add:
            if self.residual_factor is not None:
                residual = residual * self.residual_factor.reshape(self._channel_shape(y.dim()))
            y = y + residual
        if self.activation is not None:
            # in place when no gradient flows (y is this module's own tensor); under autograd
            # an in-place ReLU6 first copies its input for the backward pass
            y = activate(self.activation, y, inplace=not y.requires_grad)
        # y is this module's own tensor (float_op_forward returns a new one): without
        # autograd it is rounded in place
        return self.quantize_output(y, own=True)

    def fused_description(self) -> str:
        parts = [type(self).__name__]
        if self.bn is not None:
            parts.append("bn")
        if self.add:
            parts.append("add")
        if self.activation:
            parts.append(self.activation)
        return "+".join(parts)

    def extra_repr(self) -> str:
        fused = self.fused_description()
        return f"{self._hyper_repr()}, fused={fused}, {super().extra_repr()}"

    def _hyper_repr(self) -> str:  # pragma: no cover
        return ""


class _ConvBase(WeightedQAT):
    _DIM = 2
    _TRANSPOSED = False

    def _copy_hyperparameters(self, conv: nn.Module) -> None:
        if not isinstance(conv, self._FLOAT):
            raise TypeError(
                f"{type(self).__name__} replaces {self._FLOAT}, got {type(conv).__name__}"
            )
        self.in_channels_ = conv.in_channels
        self.out_channels_ = conv.out_channels
        self.kernel_size = conv.kernel_size
        self.stride = conv.stride
        self.padding = conv.padding
        self.dilation = conv.dilation
        self.groups = conv.groups
        self.padding_mode = conv.padding_mode
        self.output_padding = getattr(conv, "output_padding", None)
        self._reversed_padding_repeated_twice = getattr(
            conv, "_reversed_padding_repeated_twice", None
        )

    @property
    def out_channels(self) -> int:
        return self.out_channels_

    @property
    def in_channels(self) -> int:
        return self.in_channels_

    def _float_op(self) -> nn.Module:
        cls = self._FLOAT[0]
        kwargs = dict(
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.groups,
            bias=self.bias is not None,
        )
        if self._TRANSPOSED:
            kwargs["output_padding"] = self.output_padding
        else:
            kwargs["padding_mode"] = self.padding_mode
        op = cls(
            self.in_channels_,
            self.out_channels_,
            self.kernel_size,
            device=self.weight.device,
            **kwargs,
        )
        op.weight = self.weight
        if self.bias is not None:
            op.bias = self.bias
        return op

    def _hyper_repr(self) -> str:
        return (
            f"{self.in_channels_}, {self.out_channels_}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, groups={self.groups}"
        )


_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT_FN = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _Conv(_ConvBase):
    def float_op_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        fn = _CONV_FN[self._DIM]
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return fn(x, weight, bias, self.stride, 0, self.dilation, self.groups)
        return fn(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class _ConvTranspose(_ConvBase):
    _TRANSPOSED = True
    _PATTERN_ANCHOR = "convtranspose"

    def float_op_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        fn = _CONVT_FN[self._DIM]
        return fn(
            x,
            weight,
            bias,
            self.stride,
            self.padding,
            self.output_padding,
            self.groups,
            self.dilation,
        )

    def weight_to_out_major(self, w: Tensor) -> Tensor:
        return swap_group_axes(w, self.groups)

    def weight_from_out_major(self, w: Tensor) -> Tensor:
        return swap_group_axes(w, self.groups)


class Conv1d(_Conv):
    """QAT Conv1d (optionally fused with BN, add, ReLU/ReLU6)."""

    _FLOAT = (nn.Conv1d,)
    _DIM = 1


class Conv2d(_Conv):
    """QAT Conv2d (optionally fused with BN, add, ReLU/ReLU6)."""

    _FLOAT = (nn.Conv2d,)
    _DIM = 2


class Conv3d(_Conv):
    """QAT Conv3d (optionally fused with BN, add, ReLU/ReLU6)."""

    _FLOAT = (nn.Conv3d,)
    _DIM = 3


class ConvTranspose1d(_ConvTranspose):
    """QAT ConvTranspose1d (optionally fused with BN, ReLU)."""

    _FLOAT = (nn.ConvTranspose1d,)
    _DIM = 1


class ConvTranspose2d(_ConvTranspose):
    """QAT ConvTranspose2d (optionally fused with BN, ReLU)."""

    _FLOAT = (nn.ConvTranspose2d,)
    _DIM = 2


class ConvTranspose3d(_ConvTranspose):
    """QAT ConvTranspose3d (optionally fused with BN, ReLU)."""

    _FLOAT = (nn.ConvTranspose3d,)
    _DIM = 3


class Linear(WeightedQAT):
    """QAT Linear (optionally fused with BatchNorm1d, ReLU/ReLU6)."""

    _FLOAT = (nn.Linear,)
    _out_axis = -1

    def _copy_hyperparameters(self, linear: nn.Module) -> None:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"qat.Linear replaces nn.Linear, got {type(linear).__name__}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    @property
    def out_channels(self) -> int:
        return self.out_features

    _PATTERN_ANCHOR = "linear"

    def _float_op(self) -> nn.Module:
        op = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
        )
        op.weight = self.weight
        if self.bias is not None:
            op.bias = self.bias
        return op

    def float_op_forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.linear(x, weight, bias)

    def _channel_shape(self, ndim: int) -> list[int]:
        # BatchNorm1d after a linear normalises dim 1 of a [N, C] output
        shape = [1] * ndim
        shape[1 if (self.bn is not None and ndim == 2) else -1] = -1
        return shape

    def _hyper_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
