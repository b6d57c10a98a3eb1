"""Quantization: QAT (torchao QATConfig), PTQ, exports that other tools load (HF torchao, GGUF, ExecuTorch), and
`load_checkpoint`, which loads any model folder these write (float, QAT-trained or torchao-quantized)."""

from .load import load_checkpoint
from .ptq import quantize_model, size_on_disk, summarize_sizes
from .qat import (
    KD_QAT_KEYS,
    QAT_METADATA_FILE,
    QATSettings,
    check_qat_convert_config,
    compile_fake_quantizers,
    convert_qat,
    fake_quant_enabled_at,
    finish_qat,
    load_for_convert,
    prepare_qat,
    prepare_qat_student,
    prepare_qat_training,
    qat_metadata,
    read_qat_metadata,
    set_fake_quant_enabled,
    write_qat_metadata,
)
from .schemes import QAT_SCHEMES, SCHEMES, base_config, check_device

__all__ = [
    "KD_QAT_KEYS",
    "QAT_METADATA_FILE",
    "QAT_SCHEMES",
    "QATSettings",
    "SCHEMES",
    "base_config",
    "check_device",
    "check_qat_convert_config",
    "compile_fake_quantizers",
    "convert_qat",
    "finish_qat",
    "fake_quant_enabled_at",
    "load_checkpoint",
    "load_for_convert",
    "prepare_qat",
    "prepare_qat_student",
    "prepare_qat_training",
    "qat_metadata",
    "quantize_model",
    "read_qat_metadata",
    "set_fake_quant_enabled",
    "size_on_disk",
    "summarize_sizes",
    "write_qat_metadata",
]
