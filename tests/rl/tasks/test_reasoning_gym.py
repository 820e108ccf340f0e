"""``task=reasoning_gym`` (fast tier, no model): the reward is the dataset's own ``score_answer``
on the extracted answer, the held-out split never repeats a training question, an unknown
dataset name is one line naming the close ones, the prompts are chat messages through the
template, and an evaluation's rows reach ``eval_completions.jsonl``."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("reasoning_gym")
pytest.importorskip("transformers")

from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.reasoning_gym import ReasoningGymTask, extract_answer
from tq_plugin.rl.tasks.tiny_text import train_tokenizer
from tq_plugin.rl.training.evaluation import EVAL_COMPLETIONS_FILE, write_eval_completions

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small byte-level tokenizer with a chat template that knows digits and the questions'
    words."""
    texts = ["State the final answer to the following arithmetic problem: 12 + 345 - 6789 =",
             "Calculate ( 56 + -33 ) * 84 / 2.", "Reply with just the final number.",
             "0123456789 <answer></answer> The answer is -1,000.5"]
    out = tmp_path_factory.mktemp("rg_tok")
    train_tokenizer(texts, vocab_size=120).save_pretrained(str(out))
    return str(out)


def make(tok_dir, **kw):
    kw.setdefault("config", SMALL)
    return ReasoningGymTask(tokenizer=tok_dir, **{"size": 40, "eval_size": 10, **kw})


@pytest.mark.parametrize("dataset", ["chain_sum", "basic_arithmetic"])
def test_the_reward_is_score_answer_on_the_extracted_answer(tok_dir, dataset):
    task = make(tok_dir, dataset=dataset, config={} if dataset == "basic_arithmetic" else SMALL)
    rows = task.rows[:12]
    gold = [r["answer"] for r in rows]
    wrong = [str(int(float(a)) + 7) for a in gold]
    entries = [{"question": r["question"], "answer": r["answer"], "metadata": r["metadata"]}
               for r in rows]
    cols = {"question": [r["question"] for r in rows], "answer": gold,
            "metadata": [r["metadata"] for r in rows]}
    right_texts = [[{"role": "assistant", "content": f"So the result is {a}"}] for a in gold]
    got_right = task.score_reward(completions=right_texts, **cols)
    got_wrong = task.score_reward(completions=[f"{w}" for w in wrong], **cols)
    assert got_right == [task.dataset.score_answer(a, e) for a, e in zip(gold, entries)]
    assert got_right == [1.0] * len(rows)
    assert got_wrong == [task.dataset.score_answer(w, e) for w, e in zip(wrong, entries)]
    assert max(got_wrong) < 1.0
    # No answer in the completion: 0, as score_answer(None, entry) says.
    assert task.score_reward(completions=["no idea"] * len(rows), **cols) == [0.0] * len(rows)


@pytest.mark.parametrize("partial", [True, False])
def test_partial_credit_off_rewards_only_fully_right_answers(tok_dir, partial):
    task = make(tok_dir, dataset="basic_arithmetic", config={}, partial_credit=partial)
    row = task.rows[0]
    entry = {"question": row["question"], "answer": row["answer"], "metadata": row["metadata"]}
    near = f"1{row['answer']}"  # the gold inside a longer number: partial credit
    assert 0.0 < task.dataset.score_answer(near, entry) < 1.0
    cols = {"question": [row["question"]] * 3, "answer": [row["answer"]] * 3,
            "metadata": [row["metadata"]] * 3}
    got = task.score_reward(completions=[row["answer"], near, "no idea"], **cols)
    assert got == [1.0, task.dataset.score_answer(near, entry) if partial else 0.0, 0.0]


def test_partial_credit_must_be_a_bool(tok_dir):
    with pytest.raises(ConfigError, match="task.partial_credit: must be true or false"):
        make(tok_dir, dataset="chain_sum", partial_credit="no")


def test_score_through_the_worker_interface_and_the_format_bonus(tok_dir):
    task = make(tok_dir, dataset="chain_sum", format_bonus=0.5)
    assert [r.name for r in task.rewards] == ["score", "format"]
    texts = [task.rows[0]["answer"], "none", "1"]
    ids = [task.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    lens = torch.tensor([len(i) for i in ids])
    padded = torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in ids], batch_first=True)
    scores = task.score(padded, lens, torch.tensor([[0], [0], [0]]), torch.ones(3, 1))
    wrong = task.dataset.score_answer("1", {"question": task.rows[0]["question"],
                                            "answer": task.rows[0]["answer"]})
    assert scores.tolist() == pytest.approx([1.5, 0.0, wrong + 0.5])


def test_the_held_out_split_never_repeats_a_training_question(tok_dir):
    # A small space (1-digit sums of 2 terms: 200 questions): collisions are certain unless
    # they are skipped.
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = make(tok_dir, dataset="chain_sum", config=tiny, size=120, eval_size=30)
    train = {r["question"] for r in task.rows}
    held = [r["question"] for r in task.eval_rows]
    assert len(held) == 30 == len(set(held)) and not train & set(held)
    # The same seeds give the same split; another dataset_seed another one.
    again = make(tok_dir, dataset="chain_sum", config=tiny, size=120, eval_size=30)
    assert [r["question"] for r in again.eval_rows] == held
    assert [r["question"] for r in again.rows] == [r["question"] for r in task.rows]
    other = make(tok_dir, dataset="chain_sum", config=tiny, size=120, eval_size=30,
                 dataset_seed=5)
    assert [r["question"] for r in other.rows] != [r["question"] for r in task.rows]
    with pytest.raises(ConfigError, match="task.eval_size: chain_sum gave only"):
        make(tok_dir, dataset="chain_sum", config=tiny, size=400, eval_size=150)


def test_an_unknown_dataset_is_one_line_naming_the_close_ones(tok_dir):
    with pytest.raises(ConfigError) as info:
        make(tok_dir, dataset="chain_summ")
    message = str(info.value)
    assert "\n" not in message and "'chain_summ'" in message and "chain_sum" in message
    assert message.startswith("task.dataset:")
    with pytest.raises(ConfigError, match="task.config: chain_sum takes no option"):
        make(tok_dir, dataset="chain_sum", config={"min_digit": 2})
    with pytest.raises(ConfigError, match="task.config: chain_sum refuses"):
        make(tok_dir, dataset="chain_sum", config={"min_digits": 3, "max_digits": 2})


def test_prompts_are_chat_messages_through_the_template(tok_dir):
    task = make(tok_dir, dataset="chain_sum", system_prompt="Be brief.")
    prompt = task.rows[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert prompt[1]["content"] == task.rows[0]["question"] + "\nReply with just the final number."
    text = task.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>")
    assert task.ids[0] == task.tokenizer(text, add_special_tokens=False).input_ids
    plain = make(tok_dir, dataset="chain_sum", answer_format="answer_tag")
    assert [m["role"] for m in plain.rows[0]["prompt"]] == ["user"]
    assert "<answer>" in plain.rows[0]["prompt"][0]["content"]


@pytest.mark.parametrize(("text", "fmt", "expected"), [
    ("12 + 30 = 42", "last_number", "42"),
    ("It is -1,000.5.", "last_number", "-1,000.5"),
    ("no number", "last_number", None),
    ("work\n\n  42  \n", "last_line", "42"),
    ("", "last_line", None),
    ("<answer> 7 </answer> then <answer>8</answer>", "answer_tag", "8"),
    ("so <answer>9", "answer_tag", "9"),
    ("9", "answer_tag", None),
])
def test_extract_answer(text, fmt, expected):
    assert extract_answer(text, fmt) == expected


def test_evaluate_keeps_its_rows_and_they_reach_the_run_dir(tok_dir, tmp_path):
    task = make(tok_dir, dataset="chain_sum", eval_size=4)
    gold = [r["answer"] for r in task.eval_rows]
    said = [gold[0], gold[1], "x", str(int(gold[3]) + 1)]
    eos = task.eos_token_id

    def generate(prompts):
        assert prompts == task.eval_ids
        return [task.tokenizer(s, add_special_tokens=False).input_ids + [eos] for s in said]

    figures = task.evaluate(generate, max_new_tokens=8)
    assert figures["accuracy"] == 0.5
    assert figures["score"] == pytest.approx(figures["reward"])
    assert [r["extracted"] for r in task.last_eval_rows] == [gold[0], gold[1], None, said[3]]
    assert write_eval_completions(task, tmp_path, step=0) == tmp_path / EVAL_COMPLETIONS_FILE
    assert write_eval_completions(task, tmp_path, step=1) is None  # drained: nothing new
    task.evaluate(generate, max_new_tokens=8)
    write_eval_completions(task, tmp_path, step=5)
    lines = [json.loads(x) for x in (tmp_path / EVAL_COMPLETIONS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [0] * 4 + [5] * 4
    assert set(lines[0]) == {"step", "prompt", "completion", "extracted", "answer", "score",
                             "reward"}
    assert lines[0]["prompt"] == task.eval_rows[0]["question"] and lines[0]["score"] == 1.0
