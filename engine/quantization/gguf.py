"""The gguf scheme: a GGUF file read as a checkpoint, Q4_0/Q4_1/Q8_0 blocks straight into
`QuantizedWeight` (`GGUFLinear` is the scheme's method).

GGUF stores a weight as rows of blocks of 32 inputs; Q4_0, Q4_1 and Q8_0 blocks already are the
in-memory form (weights.py), so reading them is slicing bytes, not dequantizing:

- Q4_1 (20 bytes: d fp16, m fp16, 16 bytes of nibbles): 4 bits, group 32, scale d, min m.
- Q4_0 (18 bytes: d fp16, 16 bytes of nibbles, weight (q - 8) * d): 4 bits, min -8 * d (exact
  in fp16: a power-of-two multiple).
- Q8_0 (34 bytes: d fp16, 32 int8): 8 bits, group 32, scale d.

Every other tensor (F32/F16/BF16 norms, and any other GGML quant type such as Q4_K or Q6_K, which
have no in-memory quantized form) is served full precision through `shape`/`read_into`; the
other quant types are dequantized with gguf's numpy dequantizer, with one log line per type.

llama.cpp's converter permutes the rows of Q and K of llama models (its rotary pairs adjacent
elements, HF's pairs the two halves of a head); the rows are put back here as transformers'
GGUF loader does. Whole rows move, so blocks stay intact.

Names are the HF names the loader expects (`model.layers.3.self_attn.q_proj.weight`), from each
architecture's table in gguf_names (which also says what else its converter changed).
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.quantization.base import WeightSource
from engine.quantization.errors import QuantizationError, QuantizationFormatError
from engine.quantization.gguf_layout import GGUFTensorInfo, read_gguf_layout
from engine.quantization.gguf_names import architecture_names, hf_name
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import QuantizedWeight

logger = logging.getLogger(__name__)

_Q = gguf.GGMLQuantizationType
_FLOAT_TYPES = {_Q.F32, _Q.F16}
# Bytes before the 16 bytes of nibbles (Q4) or the 32 int8 (Q8_0) in one block.
_BLOCK_HEADERS = {_Q.Q4_0: 2, _Q.Q4_1: 4, _Q.Q8_0: 2}
_BLOCK = 32
# Types read_into serves without a log line: BF16 is full precision, the block types also have
# a quantized form; any other type means a model running at full precision unexpectedly.
_EXPECTED_DEQUANTIZED = {*_BLOCK_HEADERS, _Q.BF16}


def find_gguf_file(model_folder: Path) -> Path | None:
    """The one .gguf file a prepared model folder carries, or None when it has none."""
    found = sorted(model_folder.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise QuantizationFormatError(f"{model_folder} holds several GGUF files ({names})")
    return found[0] if found else None


class GGUFCheckpoint:
    """The tensors of one .gguf file under their HF names, read on demand from a memory map."""

    def __init__(self, path: Path) -> None:
        self.path = path
        layout = read_gguf_layout(path)
        self.metadata = layout.metadata
        self.architecture = str(self.metadata.get("general.architecture", "unnamed"))
        self.naming = architecture_names(self.architecture)
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._experts: set[str] = set()  # per-expert slices of a stacked tensor
        for tensor in layout.tensors:
            name = hf_name(self.naming, tensor.name)
            if name is None:
                continue
            if not name.stacked_experts:
                self.tensors[name.name] = tensor
                continue
            for expert, piece in enumerate(_expert_slices(tensor)):
                self.tensors[name.name.format(expert)] = piece
                self._experts.add(name.name.format(expert))
        self._bytes = np.memmap(path, dtype=np.uint8, mode="r")
        self._head_counts = self._qk_head_counts()
        self._logged_types: set[str] = set()

    def names(self) -> list[str]:
        return list(self.tensors)

    def quantized_names(self) -> set[str]:
        """Weights whose blocks map to `QuantizedWeight` as they are (Q4_0, Q4_1, Q8_0)."""
        return {
            name
            for name, tensor in self.tensors.items()
            if tensor.kind in _BLOCK_HEADERS
            and len(tensor.ggml_shape) == 2
            and name not in self._experts  # the experts' stacked weights are full precision
        }

    def quant_type(self, name: str) -> str:
        """The GGML type of a tensor, e.g. 'Q4_1' or 'F32'."""
        return self.tensors[name].kind.name

    def shape(self, name: str) -> tuple[int, ...]:
        # GGML lists dimensions innermost first; torch outermost first.
        return tuple(reversed(self.tensors[name].ggml_shape))

    def read_quantized(self, name: str) -> QuantizedWeight:
        tensor = self.tensors[name]
        kind = tensor.kind
        if kind not in _BLOCK_HEADERS or len(tensor.ggml_shape) != 2:
            raise QuantizationFormatError(f"GGUF tensor {name} is {kind.name}: not Q4_0/Q4_1/Q8_0")
        out_features, in_features = self.shape(name)
        header = _BLOCK_HEADERS[kind]
        blocks = self._raw(tensor).reshape(out_features, in_features // _BLOCK, -1)
        scales = _fp16_field(blocks, 0)
        if kind == _Q.Q8_0:
            data = torch.from_numpy(np.ascontiguousarray(blocks[:, :, header:]).view(np.int8))
            weight = QuantizedWeight(
                8,
                out_features,
                in_features,
                _BLOCK,
                data.reshape(out_features, in_features),
                scales,
            )
        else:
            mins = _fp16_field(blocks, 2) if kind == _Q.Q4_1 else scales * -8
            data = torch.from_numpy(np.ascontiguousarray(blocks[:, :, header:]))
            weight = QuantizedWeight(
                4,
                out_features,
                in_features,
                _BLOCK,
                data.reshape(out_features, in_features // 2),
                scales,
                mins,
            )
        rows = self._row_order(name, out_features)
        if rows is None:
            return weight
        return QuantizedWeight(
            weight.bits, out_features, in_features, _BLOCK, weight.data[rows],
            weight.scales[rows], None if weight.mins is None else weight.mins[rows],
        )  # fmt: skip

    def read_into(self, name: str, destination: torch.Tensor) -> None:
        """Copy a tensor, full precision (quantized types dequantized), into destination."""
        tensor = self.tensors[name]
        kind = tensor.kind
        shape = self.shape(name)
        raw = self._raw(tensor)
        values: np.ndarray
        if kind in _FLOAT_TYPES:
            values = raw.view(np.float32 if kind == _Q.F32 else np.float16)
        else:
            if kind not in _EXPECTED_DEQUANTIZED and kind.name not in self._logged_types:
                self._logged_types.add(kind.name)
                logger.info(
                    "%s: %s tensors (first: %s) have no quantized in-memory form; "
                    "dequantized to float",
                    self.path.name, kind.name, name,
                )  # fmt: skip
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
            values = gguf.quants.dequantize(raw.reshape(byte_shape), kind)
        full = torch.from_numpy(np.array(values, copy=True)).reshape(shape)
        if self.naming.norms_plus_one and name.endswith("norm.weight"):
            full -= 1
        rows = self._row_order(name, full.shape[0])
        destination.copy_(full if rows is None else full[rows])

    def _raw(self, tensor: GGUFTensorInfo) -> np.ndarray:
        if tensor.start + tensor.nbytes > len(self._bytes):
            raise QuantizationFormatError(f"{self.path} is truncated at tensor {tensor.name}")
        return self._bytes[tensor.start : tensor.start + tensor.nbytes]

    def _qk_head_counts(self) -> dict[str, int]:
        if not self.naming.permuted_qk:
            return {}
        heads = int(self.metadata[f"{self.architecture}.attention.head_count"])
        kv_heads = int(self.metadata.get(f"{self.architecture}.attention.head_count_kv", heads))
        return {".self_attn.q_proj.": heads, ".self_attn.k_proj.": kv_heads}

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """Indices that put a permuted Q/K tensor's rows back in HF order (None: no permutation).

        llama.cpp wrote, per head, the rows (pair element j, dimension d) at d * 2 + j; HF keeps
        them at j * half + d.
        """
        for marker, heads in self._head_counts.items():
            if marker in name:
                half = rows // heads // 2
                return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)
        return None


def _expert_slices(tensor: GGUFTensorInfo) -> list[GGUFTensorInfo]:
    """Each expert's 2-D slice of a stacked [experts, rows, columns] tensor (GGML lists the
    experts' dimension last; each expert's bytes are contiguous)."""
    if len(tensor.ggml_shape) != 3:
        raise QuantizationFormatError(
            f"GGUF tensor {tensor.name} holds experts but has shape {tensor.ggml_shape}"
        )
    *matrix, experts = tensor.ggml_shape
    each = tensor.nbytes // experts
    return [
        GGUFTensorInfo(tensor.name, tuple(matrix), tensor.kind, tensor.start + e * each, each)
        for e in range(experts)
    ]


def _fp16_field(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block: [rows, blocks]."""
    raw = np.ascontiguousarray(blocks[:, :, offset : offset + 2])
    return torch.from_numpy(raw.view(np.float16).reshape(blocks.shape[0], blocks.shape[1]))


class GGUFLinear(QuantizedWeightLinear):
    """The scheme: the model folder's GGUF file (beside its HF config), its Q4_0/Q4_1/Q8_0
    blocks used as they are."""

    source = WeightSource.OWN_FILE

    @classmethod
    def open_checkpoint(cls, model_path: Path) -> GGUFCheckpoint:
        gguf_file = find_gguf_file(model_path)
        if gguf_file is None:
            raise QuantizationError(
                f"quantization='gguf' needs a .gguf file in the model folder; {model_path} has "
                "none (registry models keep theirs: run `inferq model pull` again)"
            )
        return GGUFCheckpoint(gguf_file)
