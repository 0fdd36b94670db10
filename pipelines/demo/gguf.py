"""GGUF files of a demo checkpoint's component, written with the `gguf` package the way the community's Flux and
Wan files are (quantized 2-D weights, everything else F32), under diffusers' key names (diffusers' single-file
loader takes them as they are)."""

from __future__ import annotations

from pathlib import Path


def write_gguf(pipeline_path: str, component: str, out: str | Path, quant: str = "Q8_0") -> str:
    """`component` of the pipeline at `pipeline_path` as a GGUF file: every 2-D weight whose rows split into the
    type's blocks quantized as `quant` ("F32", "F16", "Q8_0", "Q4_0", "Q5_0", ...); the rest F32."""
    import gguf
    import numpy as np
    from diffusers import DiffusionPipeline

    qtype = gguf.GGMLQuantizationType[quant]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    module = getattr(DiffusionPipeline.from_pretrained(pipeline_path), component)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch=type(module).__name__)
    for name, tensor in module.state_dict().items():
        data = tensor.float().numpy()
        if data.ndim == 2 and data.shape[-1] % block == 0 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(out)
