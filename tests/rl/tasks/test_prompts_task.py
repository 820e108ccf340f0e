"""``task=prompts``: dataset files of each type through HF datasets and clear errors for bad
ones, the tokenizer and its chat template, the seeded cursor and its checkpoint, scoring and
evaluation through the reward functions."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.prompts import PromptTask, load_rows, load_tokenizer, render
from tq_plugin.rl.tasks.rewards import RewardError
from tq_plugin.rl.tasks.tiny_text import make_tiny_model, reverse_rows

ROWS = [{"prompt": "reverse: a b", "answer": "b a", "level": 1},
        {"prompt": "reverse: c a d", "answer": "d a c", "level": 2},
        {"prompt": "reverse: e e", "answer": "e e", "level": 1}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_text")
    return make_tiny_model(out, train_rows=200, eval_rows=8)


def write(path, rows, fmt):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    {"jsonl": lambda: ds.to_json(str(path)), "json": lambda: path.write_text(json.dumps(rows)),
     "parquet": lambda: ds.to_parquet(str(path)), "csv": lambda: ds.to_csv(str(path), index=False),
     }[fmt]()
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_each_file_type_loads_its_rows(tmp_path, fmt):
    rows = load_rows(write(tmp_path / f"p.{fmt}", ROWS, fmt), prompt_key="prompt")
    assert rows == ROWS


def test_chat_message_prompts_load(tmp_path):
    rows = reverse_rows(4)
    assert load_rows(write(tmp_path / "c.jsonl", rows, "jsonl"), prompt_key="prompt") == rows


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.jsonl", None, "does not exist"),
    ("empty.jsonl", "", "is empty"),
    ("blank.jsonl", "\n\n", "holds no rows|does not read"),
    ("p.txt", "x", r"must end in one of \['.csv', '.json', '.jsonl', '.parquet'\]"),
    ("bad.jsonl", "{not json\n", "does not read as json"),
    ("nokey.jsonl", '{"question": "reverse: a b"}\n', r"has no column 'prompt' \(columns: \['question'\]\)"),
    ("int.jsonl", '{"prompt": 7}\n', "row 0 of .*int.jsonl: 'prompt' must be text or a list of"),
    ("msgs.jsonl", '{"prompt": [{"role": "user"}]}\n', "row 0 .* must be text or a list of"),
    ("emptytext.jsonl", '{"prompt": ""}\n', "row 0 .* must be text"),
])
def test_a_bad_file_is_a_config_error_naming_it(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        load_rows(path, prompt_key="prompt")
    assert str(path) in str(info.value) or "prompt_key" in str(info.value)


def test_a_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="needs a tokenizer directory"):
        load_tokenizer(None)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope'} is not a directory"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ConfigError, match=f"{tmp_path} holds no tokenizer files"):
        load_tokenizer(tmp_path)


def test_a_pretrained_path_without_a_config_names_the_path(tmp_path):
    from tq_plugin.rl.models.hf import HFCausalLM

    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no config.json"):
        HFCausalLM(8, pretrained_path=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no safetensors weights"):
        HFCausalLM(8, pretrained_path=str(tmp_path))


def test_chat_template_round_trip_and_plain_text_as_is(tiny):
    tok = load_tokenizer(tiny)
    messages = [{"role": "user", "content": "reverse: c a d"}]
    ids = render(tok, messages)
    assert tok.decode(ids) == "<|user|>reverse: c a d<|assistant|>"
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    plain = render(tok, "reverse: c a d")
    assert tok.decode(plain) == "reverse: c a d" and plain == ids[1:-1]
    assert tok.decode(tok("d a c", add_special_tokens=False).input_ids) == "d a c"


def test_messages_need_a_chat_template(tiny):
    tok = load_tokenizer(tiny)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat_template"):
        render(tok, [{"role": "user", "content": "x"}])


def _task(path, tiny, **kw):
    kw.setdefault("reward", {"_target_": "tq_plugin.rl.tasks.rewards.exact_match"})
    return PromptTask(path=str(path), tokenizer=str(tiny), **kw)


def test_special_ids_and_vocab_come_from_the_tokenizer(tmp_path, tiny):
    task = _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny)
    tok = task.tokenizer
    assert (task.eos_token_id, task.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert task.vocab_size == len(tok) and task.output_token_ids is None
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id and cfg["vocab_size"] == len(tok)


def test_the_cursor_walks_seeded_shuffles_and_resumes_from_its_state(tmp_path, tiny):
    path = write(tmp_path / "p.jsonl", [{"prompt": f"reverse: {c}", "answer": c}
                                        for c in "abcde" * 2], "jsonl")
    task = _task(path, tiny, seed=3)
    first = task.next_rows(10)
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert _task(path, tiny, seed=3).next_rows(10) == first  # seeded
    assert _task(path, tiny, seed=4).next_rows(10) != first
    task.next_rows(3)
    state = task.state_dict()
    ahead = task.next_rows(12)  # crosses into the third epoch
    resumed = _task(path, tiny, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_rows(12) == ahead
    with pytest.raises(ConfigError, match="had 11 rows, this one has 10"):
        resumed.load_state_dict({**state, "rows": 11})


def test_seek_draws_a_slot_of_the_prompt_stream_wherever_it_runs(tmp_path, tiny):
    """A disaggregated worker positions its own task at its ticket's slot: the rows it draws
    are the ones one task walking the whole stream draws there, across epochs, in any order."""
    path = write(tmp_path / "p.jsonl", [{"prompt": f"reverse: {c}", "answer": c}
                                        for c in "abcde" * 2], "jsonl")
    stream = _task(path, tiny, seed=3).next_rows(30)  # three epochs
    worker = _task(path, tiny, seed=3)
    for slot in (4, 0, 2, 4, 1):  # 6 prompts a slot, out of order and repeated
        worker.seek(slot * 6)
        assert worker.next_rows(6) == stream[slot * 6:slot * 6 + 6], slot
    with pytest.raises(ValueError, match="position must be >= 0"):
        worker.seek(-1)


def test_held_out_rows_are_never_sampled(tmp_path, tiny):
    path = write(tmp_path / "p.jsonl", [{"prompt": f"reverse: {i}", "answer": str(i)}
                                        for i in range(10)], "jsonl")
    task = _task(path, tiny, eval_size=3)
    assert len(task.rows) == 7 and len(task.eval_rows) == 3
    assert not {r["prompt"] for r in task.rows} & {r["prompt"] for r in task.eval_rows}


def _encode(task, texts):
    ids = [task.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    lens = torch.tensor([len(i) for i in ids])
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in ids], batch_first=True), lens


def test_score_decodes_completions_and_passes_the_rows_columns(tmp_path, tiny):
    task = _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny,
                 reward={"_target_": "tq_plugin.rl.tasks.rewards.exact_match", "weight": 2.0},
                 rewards={"level": {"_target_": f"{__name__}.level_reward", "weight": 1.0}})
    responses, lens = _encode(task, ["b a", "d c a"])
    targets = torch.tensor([[0], [1]])
    scores = task.score(responses, lens, targets, torch.ones(2, dtype=torch.long))
    assert scores.tolist() == pytest.approx([2.0 + 0.1, 0.0 + 0.2])
    assert SEEN["prompts"] == ["reverse: a b", "reverse: c a d"]
    assert SEEN["completions"] == ["b a", "d c a"]


SEEN: dict = {}


def level_reward(prompts, completions, level, answer):
    SEEN.update(prompts=prompts, completions=completions)
    return [0.1 * x for x in level]


def broken(prompts, completions, **_):
    return [0.0]


def test_a_broken_reward_fails_the_score_naming_it(tmp_path, tiny):
    task = _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny,
                 reward={"_target_": f"{__name__}.broken"})
    responses, lens = _encode(task, ["b a", "d c a"])
    with pytest.raises(RewardError, match="reward broken: returned 1 values for 2"):
        task.score(responses, lens, torch.tensor([[0], [1]]), torch.ones(2, dtype=torch.long))


def test_evaluate_scores_greedy_completions_of_the_held_out_rows(tmp_path, tiny):
    task = _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny,
                 eval_path=str(write(tmp_path / "e.jsonl", ROWS[:2], "jsonl")))
    answers = {tuple(task.eval_ids[0]): "b a", tuple(task.eval_ids[1]): "wrong"}

    def generate(prompts):
        return [task.tokenizer(answers[tuple(p)], add_special_tokens=False).input_ids
                + [task.eos_token_id] for p in prompts]

    assert task.evaluate(generate, max_new_tokens=4) == {"reward": 0.5, "accuracy": 0.5}


def test_multi_turn_feedback_is_tokenized_text(tmp_path, tiny):
    task = _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny, turns=2)
    good, bad = task.feedback(torch.tensor([1.0, 0.0]))
    assert task.tokenizer.decode(good) == " Correct." and task.tokenizer.decode(bad) == " Try again."
    assert task.max_sequence_length(8) >= max(len(i) for i in task.ids) + 16


def test_media_is_refused(tmp_path, tiny):
    with pytest.raises(ConfigError, match="reads no pixels"):
        _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny, media=True)


def test_policy_and_value_start_from_the_same_pretrained_backbone(tiny):
    from tq_plugin.rl.models.hf import HFCausalLM

    vocab = len(load_tokenizer(tiny))
    policy = HFCausalLM(vocab, pretrained_path=str(tiny), max_seq_len=32)
    value = HFCausalLM(vocab, pretrained_path=str(tiny), max_seq_len=32, value_head=True)
    embed = policy.backbone.get_input_embeddings().weight
    assert torch.equal(value.backbone.get_input_embeddings().weight, embed)
    assert value(torch.tensor([[1, 2, 3]])).shape == (1, 3)


def test_reward_functions_get_trls_arguments_for_each_format(tmp_path, tiny):
    """Standard data: string prompts and completions; conversational: the message lists and one
    assistant message each; special tokens skipped when decoding (TRL's batch_decode), the
    completion ids as generated, the RL step as trainer_state."""
    plain = _task(write(tmp_path / "p.jsonl", ROWS, "jsonl"), tiny)
    tok = plain.tokenizer
    ids = tok("b a", add_special_tokens=False).input_ids
    with_pad = torch.tensor([[tok.pad_token_id, *ids, tok.bos_token_id]])
    plain.set_step(4, 10)
    call = plain.reward_call([plain.rows[0]], with_pad, torch.tensor([len(ids) + 2]))
    assert call.prompts == ["reverse: a b"] and call.completions == ["b a"]
    assert call.completion_ids == [[tok.pad_token_id, *ids, tok.bos_token_id]]
    assert call.columns == {"answer": ["b a"], "level": [1]}
    assert (call.trainer_state.global_step, call.trainer_state.max_steps) == (4, 10)
    chat = _task(write(tmp_path / "c.jsonl", reverse_rows(2), "jsonl"), tiny)
    call = chat.reward_call([chat.rows[0]], with_pad, torch.tensor([len(ids) + 2]))
    assert call.prompts == [chat.rows[0]["prompt"]]
    assert call.completions == [[{"role": "assistant", "content": "b a"}]]
