"""A GGUF's scalar metadata read without gguf's GGUFReader (which parses every vocabulary entry): the same
values as GGUFReader gives, arrays of every kind stepped over and their elements counted; a file that is not
GGUF is refused. The transformers config of a file is read once, and again once the file changes."""
import gguf
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from starshard.checkpoints.convert import gguf_array_items, gguf_hf_config, read_gguf_metadata


def write(path, context_length=64, big_endian=False, nested=True):
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    w.add_name("tiny ünïcode")
    w.add_block_count(1)
    w.add_context_length(context_length)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_token_list(["<s>", "</s>", "a", "bb", "ccc"])  # a string array amid the scalars
    w.add_token_scores([0.0, 0.0, -1.0, -2.0, -3.0])
    w.add_array("test.ints", [1, 2, 3])
    if nested:  # transformers' reader refuses arrays of arrays
        w.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    ints = [(GGUFValueType.UINT8, 200), (GGUFValueType.INT8, -2), (GGUFValueType.UINT16, 60000),
            (GGUFValueType.INT16, -300), (GGUFValueType.INT32, -70000), (GGUFValueType.UINT64, 2**40),
            (GGUFValueType.INT64, -(2**40))]
    for i, (vtype, value) in enumerate(ints):
        w.add_key_value(f"test.int{i}", value, vtype)
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 0.1)
    w.add_tensor("token_embd.weight", np.zeros((5, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reader_scalars(path):
    meta = {}
    for key, field in GGUFReader(str(path)).fields.items():
        if field.types[0] == GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        meta[key] = bytes(value).decode("utf-8") if field.types[0] == GGUFValueType.STRING else value[0].item()
    return meta


@pytest.mark.parametrize("big_endian", [False, True])
def test_scalars_equal_gguf_readers(tmp_path, big_endian):
    path = write(tmp_path / "m.gguf", big_endian=big_endian)
    meta, want = read_gguf_metadata(path), reader_scalars(path)
    assert meta == want and {k: type(v) for k, v in meta.items()} == {k: type(v) for k, v in want.items()}
    assert meta["general.name"] == "tiny ünïcode" and meta["test.flag"] is True and meta["test.int1"] == -2
    assert "tokenizer.ggml.tokens" not in meta and "test.nested" not in meta


@pytest.mark.parametrize("nested", [False, True])
def test_array_items_count_every_element(tmp_path, nested):
    """What a first load's estimate reads: the metadata arrays' elements, as GGUFReader holds them (a nested
    array's inner elements counted too: [[1, 2], [3]] is 2 + 3)."""
    path = write(tmp_path / "m.gguf", nested=nested)
    fields = GGUFReader(str(path)).fields.values()
    flat = sum(len(f.data) for f in fields if f.types[0] == GGUFValueType.ARRAY and f.types[1] != GGUFValueType.ARRAY)
    assert flat == 5 + 5 + 3
    assert gguf_array_items(path) == flat + (2 + 3 if nested else 0)


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="x.gguf is not a GGUF file"):
        read_gguf_metadata(path)


@pytest.mark.parametrize("keep", [4, 30, 200, 990])
def test_truncated_header_is_refused(tmp_path, keep):
    path = write(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match="t.gguf: the GGUF header is truncated or corrupt"):
        read_gguf_metadata(path)


def test_config_is_read_again_after_the_file_changes(tmp_path):
    path = write(tmp_path / "m.gguf", context_length=64, nested=False)
    assert gguf_hf_config(path)["max_position_embeddings"] == 64
    cfg = gguf_hf_config(path)
    cfg["max_position_embeddings"] = 1  # callers get their own copy
    assert gguf_hf_config(path)["max_position_embeddings"] == 64
    write(path, context_length=96, nested=False)
    assert gguf_hf_config(path)["max_position_embeddings"] == 96
