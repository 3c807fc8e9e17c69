"""load_tokenizer skips transformers' defensive deep copy of the freshly parsed tokenizer.json (a second
full parse): the tokenizer it returns must behave exactly like AutoTokenizer's."""

from pathlib import Path

import pytest

# The team's shared/ folder sits beside the checkout (CI lays a copy there); never part of the package.
LLAMA31 = next((base / "shared" / "tokenizers" / "llama-3.1" for base in Path(__file__).resolve().parents
                if (base / "shared" / "tokenizers" / "llama-3.1" / "tokenizer.json").exists()), Path("/nonexistent"))


@pytest.mark.skipif(not (LLAMA31 / "tokenizer.json").exists(), reason="the Llama 3.1 tokenizer folder is not beside the checkout")
def test_fast_load_equals_autotokenizer():
    import copy

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from kvserve.model.default_model import load_tokenizer

    ours = load_tokenizer(LLAMA31)
    reference = AutoTokenizer.from_pretrained(str(LLAMA31))
    text = "Hello <|eot_id|> world ÿ 你好, 3.14 — tabs\tand\nnewlines " * 3
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours(text)["input_ids"] == reference(text)["input_ids"]
    assert ours.decode(ours(text)["input_ids"]) == reference.decode(reference(text)["input_ids"])
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == \
        (reference.eos_token_id, reference.bos_token_id, reference.all_special_ids)
    # The shortcut is scoped to the load: deep copies made afterwards are real copies again.
    assert Tokenizer not in copy._deepcopy_dispatch


def test_shortcut_ends_with_the_last_of_overlapping_loads():
    """The engine loads its tokenizer on a thread while another load may run: the identity deep copy must be
    registered while any load runs and gone after the last one, also when the first to start ends first."""
    import copy
    import threading

    from tokenizers import Tokenizer

    from kvserve.model.default_model import _shared_fresh_tokenizer_objects

    first_in, second_in = threading.Event(), threading.Event()

    def first():
        with _shared_fresh_tokenizer_objects():
            first_in.set()
            second_in.wait(30)  # ends while the second load still runs

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(30)
    with _shared_fresh_tokenizer_objects():
        second_in.set()
        t.join(30)
        assert Tokenizer in copy._deepcopy_dispatch  # the second load still runs
    assert Tokenizer not in copy._deepcopy_dispatch
