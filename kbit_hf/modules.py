"""KbitLinear and KbitMoE: the modules that hold packed weights and run the kbit ops.

Their parameters *are* the serialized tensors (`weight`, `weight_absmax`, `weight_scale`, `weight_codebook`, and
`<proj>`, `<proj>_absmax`, `<proj>_scale`, `<proj>_codebook` for experts), so a saved folder reloads by plain name
matching. While quantizing on the fly the weight parameter is a float placeholder of the original shape: the loader
casts the incoming checkpoint tensor to it and hands it to `quantize_param`, which returns the packed tensors.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from . import format as fmt
from . import ops

# Suffixes of the companion tensors stored next to each quantized weight.
COMPANIONS = ("_absmax", "_scale", "_codebook")
# Fused experts params that get quantized (transformers 5 MoE layout).
EXPERT_PROJS = ("gate_up_proj", "up_proj", "down_proj")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _placeholders(shape_oi: tuple[int, ...], k: int, absmax_format: str, device, float_dtype, pre_quantized: bool,
                  model_shape: tuple[int, ...]) -> dict[str, nn.Parameter]:
    """Params for one quantized weight whose stored orientation is [..., out, in] = shape_oi.

    model_shape is the float weight's shape as the model holds it (different for transposed experts).
    """
    shapes = fmt.packed_shapes(shape_oi, k)
    if pre_quantized:
        main = torch.empty(shapes["packed"], dtype=torch.uint32, device=device)
    else:
        main = torch.empty(model_shape, dtype=float_dtype, device=device)
    return {
        "": _frozen(main),
        "_absmax": _frozen(torch.empty(shapes["absmax"], dtype=fmt.ABSMAX_DTYPES[absmax_format], device=device)),
        "_scale": _frozen(torch.empty(shapes["scale"], dtype=torch.float32, device=device)),
        "_codebook": _frozen(torch.empty(shapes["codebook"], dtype=torch.float32, device=device)),
    }


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor-parallel DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def refuse_shard(module: nn.Module, what: str) -> None:
    """What needs a kbit module's whole weights (saving, dequantizing, merging) is refused on a tensor-parallel
    shard: saved under the whole layer's name, a shard would be a corrupt checkpoint."""
    if module.is_shard:
        raise NotImplementedError(f"{what}: this {type(module).__name__} holds a tensor-parallel shard of its "
                                  "weights; load the model without tp_plan to change, dequantize or save them")


def _quantize(name: str, weight_oi: torch.Tensor, codebook: torch.Tensor, k: int, absmax_format: str):
    codebook = codebook.to(weight_oi.device, copy=True)  # one tensor per module: safetensors refuses shared storage
    packed, absmax, scale = ops.quantize(weight_oi, codebook, k, absmax_format)
    return {name: packed, name + "_absmax": absmax, name + "_scale": scale, name + "_codebook": codebook}


def _keeping_format_dtypes(module: nn.Module, names, fn):
    """fn for module._apply that never changes the dtype of the kbit tensors `names` (packed weights and their
    companions have the dtypes of the format: a `model.to(torch.float16)` would otherwise round the codebook and the
    scales, or turn fp16 block scales into bf16): their result keeps the device fn chose, in the original dtype."""
    ids = {id(p) for n, p in module.named_parameters(recurse=False) if n in names}

    def apply(t):
        out = fn(t)
        if id(t) in ids and out.dtype != t.dtype:
            out = t.to(device=out.device)
        return out

    return apply


class KbitLinear(nn.Linear):
    """A Linear layer whose weight is stored as K-bit codebook indices (see kbit_hf/format.py).

    Subclasses nn.Linear so that tools dispatching on nn.Linear (PEFT's LoRA) wrap it; the forward is
    differentiable with respect to the input. Under tensor parallelism `in_features` / `out_features` stay the whole
    layer's (transformers' hooks size the gathered activations with them) and `local_in_features` /
    `local_out_features` are the shard this process holds (kbit_hf/tensor_parallel.py).
    """

    # transformers' tensor-parallel hooks hand this module plain local tensors (its parameters and activations)
    _hf_quantized_needs_local_tp = True
    # the sibling group whose fused weight this layer's rows are a view of (fuse_siblings), its place there, the
    # group's number (the parts it hangs on an input carry it), this layer's scale ratio to the group's and whether
    # the group adds a bias for it
    _siblings: KbitSiblings | None = None
    _sibling_index = 0
    _sibling_serial: int | None = None
    _sibling_ratio = 1.0
    _sibling_biased = False

    def __init__(self, in_features: int, out_features: int, bias: bool, k: int, absmax_format: str,
                 codebook: torch.Tensor, *, pre_quantized: bool, dtype=None, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features, self.local_out_features = in_features, out_features
        self.is_shard = False  # holds one tensor-parallel shard of the weight (kbit_hf/tensor_parallel.py)
        self.k, self.absmax_format = k, absmax_format
        self._codebook_init = codebook  # used by quantize_param during an on-the-fly load
        for suffix, p in _placeholders((out_features, in_features), k, absmax_format, device, dtype,
                                       pre_quantized, (out_features, in_features)).items():
            self.register_parameter("weight" + suffix, p)
        self.bias = _frozen(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self._is_hf_initialized = True  # keep the model's _init_weights away from packed tensors

    @property
    def is_packed(self) -> bool:
        return not self.weight.is_floating_point()  # a float placeholder until an on-the-fly load quantizes it

    # ---- in-memory layouts (kbit_hf/ops.py): a backend may hold the weight in a layout of its own on its device
    # (the tiled layout of large layers on sm_90); state_dict() and load_state_dict() always speak the bit planes,
    # so checkpoints never see it.
    @property
    def layout(self) -> str:
        return ops.layout_name(self.weight)

    def use_device_layout_(self) -> None:
        """Hold the weight in the layout the backends want for it on its current device."""
        if self.weight.device.type == "meta" or not self.is_packed:
            return
        wt, at = ops.device_layout(self.weight, self.weight_absmax, self.local_out_features, self.local_in_features,
                                   self.k, self.absmax_format)
        if wt is not self.weight:
            self.weight, self.weight_absmax = _frozen(wt), _frozen(at)

    def _bit_planes(self) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.bit_planes(self.weight, self.weight_absmax, self.local_in_features, self.k)

    def _apply(self, fn, recurse=True):
        # A move between devices (.to / .cuda / .cpu) leaves the layout from_pretrained would have chosen there;
        # other _apply calls (dtype casts, share_memory_) keep it, and so do moves off the meta device (no data yet).
        before = self.weight.device
        if self._siblings is not None and fn(torch.empty(0, device=before)).device != before:
            self._siblings.split()  # each layer moves (and takes its device's layout) on its own
        super()._apply(_keeping_format_dtypes(self, ("weight",) + tuple("weight" + c for c in COMPANIONS), fn), recurse)
        if self._siblings is not None and not _shares_storage(self.weight, self._siblings.packed):
            self._siblings.split()  # new storage on the same device (to_empty): the fused weight no longer holds it
        after = self.weight.device
        if after != before and before.type != "meta":
            self.use_device_layout_()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        refuse_shard(self, "state_dict")
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.is_packed:
            planes = self._bit_planes()
            if self._siblings is not None and _shares_storage(planes[0], self.weight):
                planes = tuple(t.clone() for t in planes)  # a view of the fused weight: save its own bytes only
            destination[prefix + "weight"], destination[prefix + "weight_absmax"] = planes

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self._siblings is not None:
            keys = ("weight", "bias") + tuple("weight" + c for c in COMPANIONS)
            if not any(prefix + key in state_dict for key in keys):
                # a load of other keys (an adapter's passes by every module) leaves the fused weight alone
                return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
            self._siblings.split()
        if self.is_packed:
            planes = self._bit_planes()
            self.weight, self.weight_absmax = _frozen(planes[0]), _frozen(planes[1])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.use_device_layout_()

    def quantize_param(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if name != "weight":
            raise ValueError(f"KbitLinear only quantizes 'weight', not {name!r}")
        # under tensor parallelism the loader hands over this process's shard, the shape of the placeholder's
        expected = tuple(local_view(self.weight).shape)
        if tuple(value.shape) != expected:
            raise ValueError(f"checkpoint weight has shape {tuple(value.shape)}, the layer expects {expected}")
        return _quantize("weight", value, self._codebook_init, self.k, self.absmax_format)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        refuse_shard(self, "dequantized_weight")
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        return ops.dequantize(self.weight, self.weight_absmax, self.weight_scale, self.weight_codebook, self.k,
                              self.local_in_features, dtype)

    def set_weight_(self, weight: torch.Tensor) -> None:
        """Store the float `weight` [out, in] quantized into this layer's format (its k, stored codebook and
        absmax_format), in the layout the backends want on the layer's device. Used to merge LoRA adapters
        (kbit_hf/peft_integration.py): the result is exactly what quantizing `weight` from scratch gives."""
        refuse_shard(self, "set_weight_")
        if not self.is_packed:
            raise ValueError("set_weight_: this KbitLinear holds a float placeholder (an on-the-fly load that has not "
                             "quantized it yet), not a packed weight")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"set_weight_: weight has shape {tuple(weight.shape)}, the layer is "
                             f"{(self.out_features, self.in_features)}")
        if self.weight.is_meta:
            raise ValueError("set_weight_: the layer's weight is offloaded (a meta tensor under accelerate's hooks); "
                             "load the model without disk or CPU offload to change its weights")
        codebook = self.weight_codebook.detach()
        packed, absmax, scale = ops.quantize(weight.detach().to(codebook.device, torch.float32).contiguous(), codebook,
                                             self.k, self.absmax_format)
        if self._siblings is not None:  # rewrite this layer's rows of the fused weight: the group stays fused
            self._siblings.replace(self, packed, absmax, scale)
            return
        self.weight, self.weight_absmax, self.weight_scale = _frozen(packed), _frozen(absmax), _frozen(scale)
        self.use_device_layout_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._pending_part(x)
        if y is None:
            siblings = self._siblings
            if siblings is None or self._bias_since_fusing() or not siblings.serves(self, x):
                return ops.linear_forward(x, self.weight, self.weight_absmax, self.weight_scale,
                                          self.weight_codebook, self.k, self.local_in_features, self.bias)
            y = siblings.fused_part(self, x)
        ratio = self._sibling_ratio
        return y * ratio if ratio != 1.0 else y

    def _bias_since_fusing(self) -> bool:
        """A bias set on a member fused without one: the member runs alone. (A member fused with a bias does not
        read it here: reaching the tensor the group adds by a second path would add a Python identity guard; eager,
        KbitSiblings.serves checks every member's bias.)"""
        return not self._sibling_biased and self.bias is not None

    def _pending_part(self, x: torch.Tensor) -> torch.Tensor | None:
        """This layer's part of the fused product of x that a sibling computed (KbitSiblings), if x still holds it.
        Compiled, it reads nothing of the group: reaching the group object from a second member would add a guard
        evaluated in Python (an identity check between the two paths) to every call of the compiled model."""
        held = getattr(x, "_kbit_sibling_parts", None)
        if held is None or self._sibling_serial is None or held[0] != self._sibling_serial or self._bias_since_fusing():
            return None
        parts, i = held[2], self._sibling_index
        if parts[i] is None:
            return None
        if not torch.compiler.is_compiling():  # eager: x unmodified and no weight rewritten since the fused call
            siblings = self._siblings
            if siblings is None or held[1] != siblings.key(x):
                return None
        y = parts[i]
        parts[i] = None
        if all(p is None for p in parts):  # every part handed out: x holds no outputs
            x._kbit_sibling_parts = None
        return y

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=dtype)
        layer.weight = nn.Parameter(self.dequantized_weight(dtype), requires_grad=False)
        if self.bias is not None:
            layer.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return layer

    def extra_repr(self) -> str:
        layout = f", layout={self.layout}" if self.is_packed and self.layout != "bit planes" else ""
        fused = f", fused_with={self._siblings.names}" if self._siblings is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"k={self.k}, absmax_format={self.absmax_format}{layout}{fused}")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# Sibling projections: layers of one parent that transformers' models apply to the same input one after the other
# (the attention's q / k / v, the gated MLP's gate / up, DeepSeek's latent attention's query and compressed-KV
# projections). Computing them as one layer reads the input once and launches one kernel instead of three (or two);
# small layers such as a GQA model's k_proj / v_proj run far from their bytes on their own.
SIBLING_SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
                ("q_proj", "kv_a_proj_with_mqa"))


_group_serials = itertools.count()  # KbitSiblings numbers


def _exporting() -> bool:
    """torch.export is tracing. (Before torch 2.13, TorchDynamo read torch.compiler.is_exporting() as True inside every
    torch.compile, which would keep compiled groups unfused: read the flag it returns where torch has it.)"""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


class KbitSiblings(nn.Module):
    """Sibling KbitLinear layers held as row blocks of one packed weight and computed by one call.

    The fused weight holds the members' rows one after the other, in the layout the backends want for the fused
    shape; each member's weight and block scales are views of its rows (no second copy), which also run on their
    own. The first member called on an input x computes every member's product and hangs the others' parts on x
    until they are called with that same, unmodified tensor (identity, as the models call them); a member that finds
    no part of its own on its input computes the group's product of that input. Each member keeps its own per-tensor
    scale: the fused call uses the first's and the others' parts are multiplied by their ratio, a power of two (exact
    in bf16 and fp32; fp16 only fuses when the scales are equal). The fused call's bias is built from the members'
    biases at each call (each over its ratio, zeros for a member without one), so in-place changes, casts and
    gradients reach them as they would alone. A device move, to_empty or load_state_dict into a member splits the
    group; set_weight_ rewrites the member's rows in place; a deep copy's members run alone; so does, in eager mode,
    a DataParallel replica, and the whole group once a member's weight, block scales or scale was swapped for another
    tensor.

    A module that is nobody's child (the members hold it in their __dict__): state_dict, parameters() and .to() never
    see it, and TorchDynamo checks it, as any module, by its __dict__'s version tag. Its attributes do not change
    between calls (the pending parts live on the input), so a compiled step's guard check skips it.
    """

    def __init__(self, members: list[KbitLinear], names: tuple[str, ...], fused: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        first = members[0]
        self.members, self.names = tuple(members), names
        self.serial = next(_group_serials)
        self.packed, self.absmax = _frozen(fused[0]), _frozen(fused[1])
        self.k, self.in_features = first.k, first.local_in_features
        self.widths = tuple(m.local_out_features for m in members)  # each member's rows, in order
        self.generation = 0  # counts rewritten weights: parts computed before one are not handed out
        self.refresh()

    def refresh(self) -> None:
        """Read the members' scales (again, after a member's new weight)."""
        first = self.members[0]
        self.ratios = tuple(float(m.weight_scale) / float(first.weight_scale) for m in self.members)
        self.same_scale = all(r == 1.0 for r in self.ratios)
        self.scale, self.codebook = first.weight_scale, first.weight_codebook
        # each member's tensors as it held them when fused (its views, its scale, its bias): the fused call reads the
        # biases from here, so that a compiled call reaches each member only by its own path
        self.held = tuple((m.weight, m.weight_absmax, m.weight_scale, m.bias) for m in self.members)
        for i, (m, ratio) in enumerate(zip(self.members, self.ratios)):
            m._sibling_index, m._sibling_serial, m._sibling_ratio = i, self.serial, ratio
            m._sibling_biased = m.bias is not None

    def __deepcopy__(self, memo):
        return None  # a copy's members hold copies of their rows, no longer views of one weight: they run alone

    def replace(self, member: KbitLinear, packed, absmax, scale) -> None:
        """Store a new quantized weight (bit planes) of `member` in its rows of the fused weight."""
        packed, absmax = ops.layout_like(self.packed, packed, absmax, self.in_features, self.k)
        with torch.no_grad():
            member.weight.copy_(packed)
            member.weight_absmax.copy_(absmax)
        member.weight_scale = _frozen(scale)
        self.generation += 1
        self.refresh()

    def serves(self, member: KbitLinear, x: torch.Tensor) -> bool:
        """The fused call computes the members' products of x: not for fp16 with unequal scales, not while exporting
        (an exported program keeps each layer's own parameters), and in eager mode not for a layer that is not the
        member itself (a DataParallel replica) nor once a member's weight, block scales or scale was swapped for
        another tensor (torch.func.functional_call, accelerate's offload hooks): then every member runs alone, so
        that none computes parts nobody takes."""
        if (x.dtype == torch.float16 and not self.same_scale) or _exporting():
            return False
        if torch.compiler.is_compiling():
            return True
        return member is self.members[member._sibling_index] and all(
            m.weight is w and m.weight_absmax is a and m.weight_scale is s and m.bias is b
            for m, (w, a, s, b) in zip(self.members, self.held))

    def _bias(self) -> torch.Tensor | None:
        """The fused call's bias: each member's over its ratio (exact for a power of two; the kernel adds it in fp32
        before rounding, as for the member alone, and the part times its ratio is the member's output)."""
        biases = [h[3] for h in self.held]
        like = next((b for b in biases if b is not None), None)
        if like is None:
            return None
        return torch.cat([(b if r == 1.0 else b / r) if b is not None else like.new_zeros(n)
                          for b, r, n in zip(biases, self.ratios, self.widths)])

    def key(self, x: torch.Tensor) -> tuple:
        """What a fused call's parts of x are valid for: this group's weights (generation) and, in eager mode, x's
        version (an inference tensor has none)."""
        unversioned = torch.compiler.is_compiling() or x.is_inference()
        return self.generation, None if unversioned else x._version

    def fused_part(self, member: KbitLinear, x: torch.Tensor) -> torch.Tensor:
        """Compute every member's rows of the product of x (biases over their ratios included) in one call, hang the
        others' parts on x (KbitLinear._pending_part hands them out) and return member's, not yet times its ratio."""
        y = ops.linear_forward(x, self.packed, self.absmax, self.scale, self.codebook, self.k, self.in_features,
                               self._bias())
        parts = list(y.split_with_sizes(self.widths, -1))  # one op for every member's view
        mine = parts[member._sibling_index]
        parts[member._sibling_index] = None
        x._kbit_sibling_parts = (self.serial, self.key(x), parts)
        return mine

    def split(self) -> None:
        """Give every member its own tensors again (in the layout its own shape gets) and dissolve the group."""
        for m in self.members:
            m._siblings, m._sibling_serial, m._sibling_biased = None, None, False
            planes = ops.bit_planes(m.weight, m.weight_absmax, m.local_in_features, m.k)
            m.weight, m.weight_absmax = _frozen(planes[0].clone()), _frozen(planes[1].clone())
            m.use_device_layout_()
        self.members, self.held = (), ()


def _can_fuse(members: list) -> bool:
    first = members[0]
    if not all(isinstance(m, KbitLinear) for m in members):
        return False
    bias = next((m.bias for m in members if m.bias is not None), None)
    return all(
        m.is_packed and not m.is_shard and m._siblings is None and not m.weight.is_meta
        and (m.bias is None or (m.bias.dtype, m.bias.device) == (bias.dtype, bias.device))
        and m.k == first.k and m.absmax_format == first.absmax_format
        and m.local_in_features == first.local_in_features and m.weight.device == first.weight.device
        and bool(torch.equal(m.weight_codebook, first.weight_codebook))
        for m in members)


def fuse_siblings(model: nn.Module, skip=()) -> int:
    """Fuse every set of sibling projections (SIBLING_SETS) whose layers can share one weight: KbitLinear layers of
    one K, absmax format, codebook, input width and device, biases (if any) of one dtype, not tensor-parallel
    shards, not under `skip` (module names, e.g. offloaded ones), not in a cross-attention (its members read two
    inputs). Returns the number of groups made."""
    groups = 0
    for parent_name, parent in modules_outside(model, skip):
        if _is_cross_attention(parent_name, parent):
            continue
        for names in SIBLING_SETS:
            members = [getattr(parent, n, None) for n in names]
            if not _can_fuse(members):
                continue
            first = members[0]
            planes = [ops.bit_planes(m.weight, m.weight_absmax, m.local_in_features, m.k) for m in members]
            packed = torch.cat([p for p, _ in planes])
            packed, absmax = ops.device_layout(packed, torch.cat([a for _, a in planes]), packed.shape[0],
                                               first.local_in_features, first.k, first.absmax_format)
            row, views = 0, []
            for m, (p, a) in zip(members, planes):
                view = (packed[row:row + p.shape[0]], absmax[row:row + p.shape[0]])
                # the fused layout must hold each member's rows as a valid weight of its own: check, bit for bit
                back = ops.bit_planes(*view, m.local_in_features, m.k)
                if not (torch.equal(back[0], p) and torch.equal(back[1], a)):
                    views = None
                    break
                views.append(view)
                row += p.shape[0]
            if views is None:
                continue
            for m, (p, a) in zip(members, views):
                m.weight, m.weight_absmax = _frozen(p), _frozen(a)
            group = KbitSiblings(members, names, (packed, absmax))
            for m in members:
                m.__dict__["_siblings"] = group  # not a child module: state_dict and .to() leave it alone
            groups += 1
    return groups


def modules_outside(model: nn.Module, names) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of `model` that is neither one of the modules `names` nor inside one."""
    return [(name, m) for name, m in model.named_modules()
            if not any(name == n or name.startswith(n + ".") for n in names)]


def _is_cross_attention(name: str, module: nn.Module) -> bool:
    # its query reads one input, its keys and values another (the encoder's, the image's): fused, each call would
    # compute every member's rows
    last = name.rsplit(".", 1)[-1].lower()
    return "cross" in last or last in ("encoder_attn", "x_attn") or "cross" in type(module).__name__.lower()


def split_siblings(model: nn.Module) -> int:
    """Undo fuse_siblings: every fused group's layers hold their own tensors again. Returns the number split."""
    groups = {id(m._siblings): m._siblings for m in model.modules()
              if isinstance(m, KbitLinear) and m._siblings is not None}
    for group in groups.values():
        group.split()
    return len(groups)


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers-5 fused experts module: 3-D `gate_up_proj` or `up_proj`, and 3-D `down_proj`."""
    params = dict(module.named_parameters(recurse=False))
    up = params.get("gate_up_proj", params.get("up_proj"))
    down = params.get("down_proj")
    return up is not None and down is not None and up.dim() == 3 and down.dim() == 3


def fused_gating(orig: nn.Module) -> tuple[str, float, float] | None:
    """(gate, alpha, limit) of `kbit::moe_experts` that computes what an experts module's own gating does: SiLU(gate) *
    up with gate_up split in halves (the transformers default), or gpt-oss's clamped SwiGLU; None for any other."""
    if "gate_up_proj" not in orig._parameters or getattr(orig, "has_post_expert_norm", False):
        return None
    own = getattr(type(orig), "_apply_gate", None)
    if own is None or own.__qualname__ == "_default_apply_gate":  # transformers' default: act_fn(gate) * up, halves
        act = type(getattr(orig, "act_fn", None)).__name__
        return ("silu", 0.0, 0.0) if act in ("SiLU", "SiLUActivation") else None
    if own.__qualname__ == "GptOssExperts._apply_gate":
        return "clamped", float(orig.alpha), float(orig.limit)
    return None


# the selections `kbit::router_topk` computes: (mode, renorm)
_ROUTER_MODES = (("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False))


def fuse_router(router: nn.Module) -> bool:
    """Give a MoE router (a module with `weight`, `top_k` and `hidden_dim` whose forward returns (logits, weights,
    ids)) a forward that selects through `kbit::router_topk` (one kernel instead of softmax, top-k and the
    renormalisation), for inference. Installed only where the fused forward, with the op's selection computed in
    torch's ops, returns bitwise what the router's own forward returns on a probe input (all three outputs, their
    dtypes included), so routers with other semantics keep theirs. (A renormalised softmax top-k and a softmax over
    the top-k are the same function: either may be picked for the other.) Only on devices whose backend has a kernel
    for the op, and not for routers under an accelerate hook. Returns whether it was installed."""
    weight = getattr(router, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.device.type == "meta"
            or not isinstance(getattr(router, "top_k", None), int) or getattr(router, "hidden_dim", None) is None
            or hasattr(router, "_hf_hook") or "forward" in vars(router) or not ops.has_router_kernel(weight.device)):
        return False
    g = torch.Generator(device=weight.device).manual_seed(0)
    probe = torch.randn(16, router.hidden_dim, generator=g, device=weight.device).to(weight.dtype)
    try:
        with torch.no_grad():
            own = type(router).forward(router, probe)
            if not (isinstance(own, tuple) and len(own) == 3 and all(isinstance(t, torch.Tensor) for t in own)):
                return False
            for mode, renorm in _ROUTER_MODES:
                router._kbit_router = (mode, renorm, own[1].dtype)
                fused = _router_outputs(router, probe, ops.router_topk_in_torch)
                if all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(fused, own)):
                    # a partial, not a bound method: the model stays picklable
                    router.forward = functools.partial(_fused_router_forward, router)
                    return True
    except Exception:  # noqa: BLE001 - a forward this probe cannot drive is simply left alone
        pass
    if hasattr(router, "_kbit_router"):
        del router._kbit_router
    return False


def unfuse_router(router: nn.Module) -> bool:
    """Give a router that fuse_router changed its own forward back. Returns whether it had the fused one."""
    if not hasattr(router, "_kbit_router"):
        return False
    del router.forward, router._kbit_router
    return True


def _router_outputs(router, hidden_states, select):
    mode, renorm, weights_dtype = router._kbit_router
    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight, getattr(router, "bias", None))
    weights, ids = select(logits, router.top_k, mode, renorm, weights_dtype)
    return logits, weights, ids


def _fused_router_forward(router, hidden_states):
    bias = getattr(router, "bias", None)
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_states, router.weight, bias))
    if grads or hidden_states.dtype != router.weight.dtype:  # the op has no autograd formula; the probe ran this dtype
        return type(router).forward(router, hidden_states)
    return _router_outputs(router, hidden_states, ops.router_topk)


class KbitMoE(nn.Module):
    """Fused MoE experts with K-bit expert weights, replacing a transformers-5 `*Experts` module.

    Keeps the original module's attributes, parameter-free submodules and gating (`_apply_gate`, e.g. gpt-oss's
    clamped SwiGLU), and its float biases. Weights are stored [E, out, in] even where the model keeps them
    transposed (gpt-oss). The forward has fixed shapes (no data-dependent Python control flow), so it traces. Where
    the device's backend fuses a whole block of few rows (`ops.fuses_moe`) and the gating is one it knows
    (`fused_gating`), the block is one `kbit::moe_experts` call.
    """

    def __init__(self, orig: nn.Module, k: int, absmax_format: str, codebook: torch.Tensor, *, pre_quantized: bool):
        super().__init__()
        self._orig_cls = type(orig)
        # the experts class's own gating (gpt-oss's) or None: held as the function, since the class object reached
        # from every layer of a compiled forward adds a Python identity guard per layer
        self._own_gate = getattr(self._orig_cls, "_apply_gate", None)
        self.k, self.absmax_format = k, absmax_format
        self._codebook_init = codebook
        # Copy the original's own attributes (config, num_experts, act_fn, alpha, limit, decorator flags...),
        # not nn.Module's internals.
        module_internals = set(vars(nn.Module()))
        for key, value in vars(orig).items():
            if key not in module_internals and key != "_is_hf_initialized":
                setattr(self, key, value)
        for name, child in orig.named_children():
            self.add_module(name, child)
        self.is_transposed = bool(getattr(orig, "is_transposed", False))
        self.has_gate = "gate_up_proj" in orig._parameters
        self.has_bias = bool(getattr(orig, "has_bias", False))
        self.has_post_expert_norm = bool(getattr(orig, "has_post_expert_norm", False))
        self.quantized_names: tuple[str, ...] = tuple(n for n in EXPERT_PROJS if n in orig._parameters)
        self.in_features: dict[str, int] = {}
        for name, p in orig.named_parameters(recurse=False):
            if name in self.quantized_names:
                e, a, b = p.shape
                out, inp = (b, a) if self.is_transposed else (a, b)
                self.in_features[name] = inp
                for suffix, q in _placeholders((e, out, inp), k, absmax_format, p.device, p.dtype, pre_quantized,
                                               tuple(p.shape)).items():
                    self.register_parameter(name + suffix, q)
            else:
                self.register_parameter(name, p)
        first = dict(orig.named_parameters())[self.quantized_names[0]]
        self.num_experts = int(getattr(orig, "num_experts", first.shape[0]))
        self.fused_gating = fused_gating(orig)
        self.is_shard = False  # holds one tensor-parallel shard of every expert (in_features: the shard's widths)
        self._is_hf_initialized = True

    # transformers' tensor-parallel hooks hand this module plain local tensors (its parameters and activations)
    _hf_quantized_needs_local_tp = True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        refuse_shard(self, "state_dict")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn, recurse=True):  # dtype casts leave the kbit tensors in their format dtypes
        names = tuple(n + c for n in self.quantized_names for c in ("",) + COMPANIONS)
        return super()._apply(_keeping_format_dtypes(self, names, fn), recurse)

    def quantize_param(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        if name not in self.quantized_names:
            raise ValueError(f"KbitMoE quantizes {self.quantized_names}, not {name!r}")
        # under tensor parallelism the loader hands over this process's shard, the shape of the placeholder's
        expected = tuple(local_view(getattr(self, name)).shape)
        if tuple(value.shape) != expected:
            raise ValueError(f"checkpoint {name} has shape {tuple(value.shape)}, the experts expect {expected}")
        weight_oi = value.transpose(-1, -2) if self.is_transposed else value
        return _quantize(name, weight_oi, self._codebook_init, self.k, self.absmax_format)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._own_gate is not None:
            return self._own_gate(self, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _packed(self, name: str) -> tuple[torch.Tensor, ...]:
        """(packed, absmax, scale, codebook) of one quantized projection."""
        return tuple(getattr(self, name + suffix) for suffix in ("",) + COMPANIONS)

    def _proj(self, name: str, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        y = ops.expert_linear_forward(x, expert_ids, *self._packed(name), self.k, self.in_features[name])
        if self.has_bias:
            y = y + getattr(self, name + "_bias")[expert_ids.clamp(0, self.num_experts - 1)].to(y.dtype)
        return y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        # gpt-oss names the routing arguments differently.
        top_k_index = top_k_index if top_k_index is not None else kwargs.pop("router_indices")
        top_k_weights = top_k_weights if top_k_weights is not None else kwargs.pop("routing_weights")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        num_tokens, top_k = x.shape[0], top_k_index.shape[-1]
        biases = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
        fused = self.fused_gating is not None and not self.is_shard
        if fused and ops.fuses_moe(x, num_tokens, top_k, self.num_experts, top_k_weights, *biases):
            return self._fused_forward(x, top_k_index.reshape(num_tokens, top_k),
                                       top_k_weights.reshape(num_tokens, top_k), biases).view(shape)
        expert_ids = top_k_index.reshape(-1)
        # Indices >= num_experts are expert-parallel sentinels: their rows contribute nothing.
        valid = (expert_ids >= 0) & (expert_ids < self.num_experts)
        x = x.repeat_interleave(top_k, dim=0)
        if self.has_gate:
            h = self._apply_gate(self._proj("gate_up_proj", x, expert_ids))
        else:
            h = self.act_fn(self._proj("up_proj", x, expert_ids))
        out = self._proj("down_proj", h, expert_ids)
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        weights = top_k_weights.reshape(-1).float() * valid
        out = (out.float() * weights.unsqueeze(-1)).view(num_tokens, top_k, -1).sum(dim=1)
        return out.to(hidden_states.dtype).view(shape)

    def _fused_forward(self, x, top_k_index, top_k_weights, biases):
        return ops.moe_experts_forward(x, top_k_index, top_k_weights, self._packed("gate_up_proj"), biases[0],
                                       self._packed("down_proj"), biases[1], self.k, *self.fused_gating)

    def dequantized_weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        refuse_shard(self, "dequantized_weight")
        w = ops.dequantize(*self._packed(name), self.k, self.in_features[name], dtype)
        return w.transpose(-1, -2).contiguous() if self.is_transposed else w

    def to_experts(self, dtype: torch.dtype) -> nn.Module:
        """The original experts class with dequantized float weights."""
        with torch.device("meta"):
            experts = self._orig_cls(self.config)
        for name, _ in list(experts.named_parameters(recurse=False)):
            if name in self.quantized_names:
                value = self.dequantized_weight(name, dtype)
            else:
                value = getattr(self, name).detach().to(dtype)
            setattr(experts, name, nn.Parameter(value, requires_grad=False))
        for name, child in self.named_children():
            experts.add_module(name, child)
        return experts

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, quantized={list(self.quantized_names)}, k={self.k}, "
                f"absmax_format={self.absmax_format}, transposed={self.is_transposed}")
