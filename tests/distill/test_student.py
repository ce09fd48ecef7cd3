"""Students: kept layers equal an independently assembled smaller model; config students; checks; masks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_random_model, tiny_llama_config, train_tiny_tokenizer
from references import one_line_error
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from compress.distill.config import StudentSpec
from compress.distill.student import apply_masks, build_student, keep_layers, sparsity_masks
from compress.pruners.masks import is_nm_sparse


@pytest.fixture
def teacher_dir(tmp_path, tiny_tokenizer):
    return save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=4), tmp_path / "teacher", tiny_tokenizer)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_kept_layers_equal_a_smaller_model_loaded_with_those_layers(teacher_dir, tiny_tokenizer):
    teacher = _load(teacher_dir)
    student, _ = build_student(teacher, teacher_dir, StudentSpec(layers=[0, 3]))
    # Independent reference: a fresh 2-layer Llama given the teacher's tensors, layer 3 renamed to 1.
    ref = LlamaForCausalLM(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=2)).eval()
    state = {}
    for key, value in teacher.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index not in (0, 3):
                continue
            key = key.replace(f"model.layers.{index}.", f"model.layers.{[0, 3].index(index)}.")
        state[key] = value
    ref.load_state_dict(state)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(student.eval()(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert student.config.num_hidden_layers == 2
    assert teacher.config.num_hidden_layers == 4 and len(teacher.model.layers) == 4  # teacher untouched
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1]


def test_every_second_layer(teacher_dir):
    teacher = _load(teacher_dir)
    a, _ = build_student(teacher, teacher_dir, StudentSpec(every=2))
    b = keep_layers(teacher, [0, 2])
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_config_student_is_narrower_with_the_same_vocabulary(teacher_dir, tiny_tokenizer):
    teacher = _load(teacher_dir)
    student, _ = build_student(teacher, teacher_dir, StudentSpec(config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}))
    assert student.get_output_embeddings().weight.shape == (len(tiny_tokenizer), 32)
    assert len(student.model.layers) == 1
    assert teacher.config.hidden_size == 64


def test_bad_students_are_one_line_errors(teacher_dir, tmp_path, calib_text):
    teacher = _load(teacher_dir)
    assert "0..3" in one_line_error(build_student, teacher, teacher_dir, StudentSpec(layers=[0, 7]))
    assert "hidden_sise" in one_line_error(build_student, teacher, teacher_dir, StudentSpec(config={"hidden_sise": 3}))
    other_tok = train_tiny_tokenizer(calib_text[-30000:], vocab_size=300)
    other = save_random_model(tiny_llama_config(len(other_tok)), tmp_path / "other", other_tok)
    assert "tokenizer" in one_line_error(build_student, teacher, teacher_dir, StudentSpec(checkpoint=other))
    quantized = save_random_model(tiny_llama_config(teacher.config.vocab_size), tmp_path / "q")
    config = json.loads((quantized / "config.json").read_text())
    config["compression"] = {"stages": [{"method": "gptq", "bits": 4}]}
    (quantized / "config.json").write_text(json.dumps(config))
    assert "quantiz" in one_line_error(build_student, teacher, teacher_dir, StudentSpec(checkpoint=quantized))


def test_spec_needs_exactly_one_kind():
    with pytest.raises(ValueError):
        StudentSpec(layers=[0], every=2)
    with pytest.raises(ValueError):
        StudentSpec()


def test_masks_found_only_on_sparse_layers_and_applied(teacher_dir):
    model = _load(teacher_dir)
    w = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        # 2:4 by hand: zero the two smallest |w| of every group of 4 input columns
        groups = w.abs().reshape(w.shape[0], -1, 4)
        drop = groups.argsort(dim=2)[:, :, :2]
        keep = torch.ones_like(groups, dtype=torch.bool).scatter_(2, drop, False).reshape(w.shape)
        w.mul_(keep)
    masks = sparsity_masks(model)
    assert list(masks) == ["model.layers.1.mlp.up_proj"]
    assert torch.equal(masks["model.layers.1.mlp.up_proj"], keep)
    with torch.no_grad():
        w.add_(1.0)  # a training step that would fill the zeros
    apply_masks(model, masks)
    assert is_nm_sparse(w, 2, 4) and torch.equal(w != 0, keep)
