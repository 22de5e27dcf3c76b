"""Tests of tasks.py: toy examples, rewards, the character tokenizer, prompt encoding, JSONL loading."""
import json
import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import tasks
from tasks import (
    ALPHABET, TASKS, char_tokenizer, encode_prompt, encode_target, extract_answer, load_jsonl,
    make_examples, numeric_reward, reward_fn,
)

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

# Each toy task's answer computed independently of tasks.py, from the prompt's digits.
EXPECTED = {
    "sort": lambda digits: "".join(sorted(digits)),
    "reverse": lambda digits: "".join(reversed(digits)),
}
MARKERS = {"sort": "S", "reverse": "R"}


def digits_of(prompt, task):
    """The digits of a toy prompt, checking its format "<marker><digits>=" on the way."""
    match = re.fullmatch(MARKERS[task] + r"(\d+)=", prompt)
    assert match, f"bad {task} prompt {prompt!r}"
    return match.group(1)


# ---------------------------------------------------------------- toy tasks


def test_every_task_is_tested():
    assert set(TASKS) == set(EXPECTED) | {"pick"}


def test_pick_hides_a_block_of_distinct_digits_among_letters():
    examples = make_examples("pick", 500, seed=1)
    sizes, seen, sides = set(), set(), set()
    for example in examples:
        match = re.fullmatch(r"P([a-p]*)(\d+)([a-p]*)=", example["prompt"])   # one block of digits
        assert match, example["prompt"]
        digits, letters = match.group(2), match.group(1) + match.group(3)
        assert len(set(digits)) == len(digits) and 2 * len(digits) <= len(letters) <= 3 * len(digits)
        assert example["answer"] == "".join(sorted(digits))
        sizes.add((len(digits), len(letters)))
        seen |= set(digits)
        sides.add((match.group(1) == "", match.group(3) == ""))
    # every size: the default 3-6 digits, each with 2n..3n letters, the extremes included
    assert sizes == {(n, m) for n in range(3, 7) for m in range(2 * n, 3 * n + 1)}
    assert seen == set("0123456789")
    assert sides == {(True, False), (False, True), (False, False)}     # the block first, last, in between
    assert make_examples("pick", 1, seed=0, min_digits=10, max_digits=10)[0]["answer"] == "0123456789"
    with pytest.raises(ValueError, match="max_digits must be <= 10"):
        make_examples("pick", 1, seed=0, min_digits=3, max_digits=11)


def test_picks_teacher_stops_one_digit_early_on_most_long_answers():
    examples = make_examples("pick", 2000, seed=2)
    taught = tasks.demonstrations("pick", examples, seed=3)
    long = [(e["answer"], t) for e, t in zip(examples, taught) if len(e["answer"]) >= 4]
    assert all(t == a or t == a[:-1] for a, t in long)
    assert 0.65 < sum(t != a for a, t in long) / len(long) < 0.75       # 70 %
    assert all(t == e["answer"] for e, t in zip(examples, taught) if len(e["answer"]) < 4)
    assert tasks.demonstrations("sort", examples[:5], seed=3) == [e["answer"] for e in examples[:5]]
    assert tasks.demonstrations("pick", examples, seed=3) == taught != tasks.demonstrations("pick", examples, seed=4)


def test_edit_match_by_hand():
    reward = reward_fn("pick")
    assert reward("0149", "0149") == 1.0 and reward(" 0149\n", "0149") == 1.0
    assert reward("014", "0149") == 0.75                                # one digit missing: 1 - 1/4
    assert reward("01459", "0149") == 0.8                               # one extra: 1 - 1/5
    assert reward("0249", "0149") == 0.75 and reward("", "0149") == 0.0 and reward("9410", "0149") == 0.0
    assert reward("", "") == 1.0                                        # nothing to compare: no division by 0
    assert tasks.edit_distance("kitten", "sitting") == 3


@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_answers_match_an_independent_computation(task):
    examples = make_examples(task, 300, seed=1)
    assert len(examples) == 300
    for example in examples:
        digits = digits_of(example["prompt"], task)
        assert example["answer"] == EXPECTED[task](digits)
    # The default lengths are the measured 12-20 digits, and all of them occur; so does every digit.
    assert {len(digits_of(e["prompt"], task)) for e in examples} == set(range(12, 21))
    assert set("".join(digits_of(e["prompt"], task) for e in examples)) == set("0123456789")


def test_lengths_are_configurable():
    examples = make_examples("reverse", 100, seed=0, min_digits=3, max_digits=5)
    assert {len(digits_of(e["prompt"], "reverse")) for e in examples} == {3, 4, 5}
    for low in (6, 0, 3.5):                            # min > max, no digit at all, or half a digit (randrange's error)
        with pytest.raises(ValueError, match=rf"^need integers 1 <= min_digits <= max_digits, got {low} and 5$"):
            make_examples("sort", 1, seed=0, min_digits=low, max_digits=5)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_longest_prompt_chars_by_brute_force(task):
    # with exactly d digits (min == max): marker + the longest body (pick: d digits + 3d letters) + "="
    for d in (3, 5):
        seen = max(len(e["prompt"]) for e in make_examples(task, 200, seed=0, min_digits=d, max_digits=d))
        assert tasks.longest_prompt_chars(task, d) == seen == {"pick": 2 + 4 * d}.get(task, 2 + d)


def test_same_seed_same_examples_other_seed_other_examples():
    assert make_examples("sort", 20, seed=7) == make_examples("sort", 20, seed=7)
    assert make_examples("sort", 20, seed=7) != make_examples("sort", 20, seed=8)


def test_unknown_task_is_named_with_the_allowed_ones():
    for call in (lambda: make_examples("sorting", 1, seed=0), lambda: reward_fn("sorting")):
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert "'sorting'" in message and all(name in message for name in TASKS)


@pytest.mark.parametrize("task", sorted(EXPECTED))
def test_reward_of_true_answer_is_1_and_of_corrupted_answers_0(task):
    reward = reward_fn(task)
    for example in make_examples(task, 20, seed=3):
        answer = example["answer"]
        assert reward(answer, answer) == 1.0
        assert reward(" " + answer + "\n", answer) == 1.0  # surrounding whitespace is ignored
        changed = answer[:-1] + str((int(answer[-1]) + 1) % 10)
        for wrong in (changed, answer[:-1], answer + "0", "", "=" + answer):
            assert reward(wrong, answer) == 0.0


def test_pick_draws_its_letters_from_a_to_p():
    # the distractors are the 16 letters a..p, every one of them (a letter dropped from PICK_LETTERS went unseen:
    # the prompt pattern [a-p]* also matches prompts that never use "p")
    letters = "".join(re.sub(r"[\d=P]", "", e["prompt"][1:]) for e in make_examples("pick", 200, seed=4))
    assert set(letters) == set("abcdefghijklmnop")


def test_examples_neither_read_nor_disturb_the_global_random_state():
    # make_examples draws from a private generator: seeding the global one (random.seed) and drawing from it would
    # still give the same examples for the same seed, but would change every random draw the caller makes next
    random.seed(5)
    expected = random.random()
    random.seed(5)
    first = make_examples("sort", 3, seed=1)
    assert random.random() == expected
    random.seed(6)
    assert make_examples("sort", 3, seed=1) == first


def test_held_out_prompts_are_no_training_seeds_prompts():
    # brute force over the integer seeds of training and warm-up steps around 0: a held-out set seeded with the
    # run's seed itself, or with -1 - seed (random.Random(-1) is Random(1)), equals one of them
    trained = {e["prompt"] for s in range(-20, 21) for e in make_examples("sort", 8, seed=s)}
    for seed in range(4):
        held = tasks.held_out_examples("sort", 8, seed)
        assert held == tasks.held_out_examples("sort", 8, seed) != tasks.held_out_examples("sort", 8, seed + 1)
        assert not {e["prompt"] for e in held} & trained


# ---------------------------------------------------------------- tokenizer and encoding


def test_char_tokenizer_has_one_token_per_character():
    tok = char_tokenizer()
    assert tok.pad_token_id == 0
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}) == 4
    ids = tok.encode(ALPHABET, add_special_tokens=False)
    assert len(ids) == len(set(ids)) == len(ALPHABET)
    assert tok.unk_token_id not in ids
    for task in TASKS:
        example = make_examples(task, 1, seed=0)[0]
        text = example["prompt"] + example["answer"]
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text) and tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    assert tok.encode("S1x", add_special_tokens=False)[-1] == tok.unk_token_id


def test_token_ids_are_pinned():
    # the ids a trained toy checkpoint was trained with, written out by hand: special tokens first (pad 0, bos 1,
    # eos 2, unk 3), then 0-9, "=", "R", "S", "P", a-p in that order; reordering SPECIAL_TOKENS or ALPHABET (bos and
    # eos swapped, "SR" for "RS") kept every test green but made every saved toy model read other tokens
    tok = char_tokenizer()
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    expected = {c: 4 + i for i, c in enumerate("0123456789")} | {"=": 14, "R": 15, "S": 16, "P": 17}
    expected |= {c: 18 + i for i, c in enumerate("abcdefghijklmnop")}
    assert {c: tok.convert_tokens_to_ids(c) for c in expected} == expected
    assert len(tok) == 34


def test_every_character_is_one_token_newlines_included():
    # one token a character, even for characters outside the alphabet: split by r"[\s\S]", as "." leaves two
    # newlines in a row one piece, one <unk> for two characters (hand count: S, 1, <unk>, <unk>, <unk>)
    tok = char_tokenizer()
    ids = tok.encode("S1\n\nx", add_special_tokens=False)
    assert ids == tok.convert_tokens_to_ids(["S", "1"]) + [tok.unk_token_id] * 3


def test_char_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tok, name)
    texts = [e["prompt"] + e["answer"] for task in TASKS for e in make_examples(task, 5, seed=2)]
    for text in texts + ["<bos>S12=12<eos>", "S1\nx"]:
        assert loaded.encode(text) == tok.encode(text)
        assert encode_prompt(loaded, text) == encode_prompt(tok, text)
    assert loaded.decode(tok.encode(texts[0])) == texts[0]


def test_encode_prompt_without_a_chat_template_puts_bos_first():
    tok = char_tokenizer()
    assert tok.chat_template is None
    assert encode_prompt(tok, "S21=") == [tok.bos_token_id] + tok.encode("S21=", add_special_tokens=False)
    tok.bos_token = None  # a tokenizer without bos, like Qwen's, gets no bos
    assert encode_prompt(tok, "S21=") == tok.encode("S21=", add_special_tokens=False)


def test_encode_prompt_uses_the_chat_template():
    tok = char_tokenizer()
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}R{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    # The template's own bos only, not a second one; the generation prompt "=" at the end.
    assert encode_prompt(tok, "12") == tok.encode("<bos>R12=", add_special_tokens=False)
    assert encode_prompt(tok, "12")[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("R")]


def test_encode_prompt_never_doubles_the_bos_of_a_tokenizer_that_adds_it_itself():
    from tokenizers.processors import TemplateProcessing
    tok = char_tokenizer()                                             # with a post-processor, as Llama's has
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    plain = tok.encode("S21=", add_special_tokens=False)
    assert tok.encode("S21=") == [tok.bos_token_id] + plain             # it adds bos by itself
    assert encode_prompt(tok, "S21=") == [tok.bos_token_id] + plain    # one bos, no template
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert encode_prompt(tok, "S21=") == [tok.bos_token_id] + plain    # one bos, the template's


def test_encode_target_is_the_answer_then_eos():
    tok = char_tokenizer()
    ids = encode_target(tok, "1123")
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == "1123"
    assert tok.decode(ids, skip_special_tokens=True) == "1123"


# ---------------------------------------------------------------- numeric reward


@pytest.mark.parametrize("completion, answer, expected", [
    ("#### 1,234", "1234", 1.0),
    ("#### 1234", "1,234", 1.0),
    ("\\boxed{42}", "42", 1.0),
    ("So the total is \\boxed{ 42 }.", "42", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    ("#### 2.50", "2.5", 1.0),
    ("#### 2.51", "2.5", 0.0),
    ("#### 5.0", "5", 1.0),
    ("#### $18", "18", 1.0),
    ("#### 72 clips", "72", 1.0),
    ("48/2 = 24 clips in May.\n48+24 = 72 altogether.\n#### 72", "72", 1.0),
    ("#### 71", "72", 0.0),
    ("#### 72.01", "72", 0.0),                                # a model's own rounding is not forgiven
    ("#### 1000.5", "1000", 0.0),
    ("no answer here", "5", 0.0),
    ("The answer is 5", "5", 0.0),  # no marker, no answer: documented in extract_answer
    ("####", "5", 0.0),
    ("#### five", "5", 0.0),
    ("\\boxed{x}", "5", 0.0),
    ("#### 5\nwait, no: \\boxed{7}", "7", 1.0),  # the last marker counts
    ("#### 5\nwait, no: \\boxed{7}", "5", 0.0),
    ("\\boxed{\\text{72}}", "72", 1.0),                    # LaTeX and markdown around the number
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{\\$72}", "72", 1.0),
    ("#### **72**", "72", 1.0),
    ("\\boxed{\\textbf{72}}", "72", 1.0),
    ("\\boxed{\\mathrm{72}}", "72", 1.0),
    ("\\boxed{1\\,000}", "1000", 1.0),                       # LaTeX's thin space: 1000, not 1
    ("\\boxed{1\\!000}", "1000", 1.0),
    ("#### 5\n####", "5", 0.0),                               # the last marker counts, even an empty one
    ("\\boxed{7}\nwait, no:\n#### 5", "5", 1.0),                # the last by place, whichever its kind: a "####"
    ("\\boxed{7}\nwait, no:\n#### 5", "7", 0.0),                # after a \boxed{} wins
    ("#### -$5", "-5", 1.0),
    ("#### $-5", "-5", 1.0),
    ("#### .5", "0.5", 1.0),
    ("#### 1,5", "15", 0.0),                                  # not a number we can read: not 15,
    ("#### 1,5", "1", 0.0),                                   # not 1 either
    ("\\boxed{\\frac{1}{2}}", "1", 0.0),
    ("#### 3*4", "34", 0.0),                                  # a product is no number we read: not 34,
    ("#### 3*4", "3", 0.0),                                   # nor its first factor
    ("#### 2*5=10", "25", 0.0),
    ("\\boxed{6*7}", "67", 0.0),
    ("#### 3*4*5", "345", 0.0),
    ("#### *72*", "72", 1.0),                                 # emphasis, single or double, still goes
    ("#### **$18**.", "18", 1.0),
    ("#### 3/4", "3", 0.0),                                   # a fraction, a power, an exponent: not their
    ("#### 2.5/4", "2", 0.0),                                 # first number
    ("#### 2^10", "2", 0.0),
    ("#### 1e3", "1", 0.0),
    ("#### 12 / 2 = 6", "12", 0.0),
    ("#### 18 - 5", "18", 0.0),                               # an unfinished sum or difference: not 18 either
    ("#### 18+2", "18", 0.0),
    ("#### 18 - $5", "18", 0.0),
    ("#### 18 − 5", "18", 0.0),                               # Unicode's minus, an en dash: the same
    ("#### 18 – 5", "18", 0.0),
    ("\\boxed{18\n- 5}", "18", 0.0),                          # inside the braces, over a line break too
    ("#### 18\n- 5 left over", "18", 1.0),                     # the marker's answer ends with its line
    ("#### 18 -", "18", 1.0),
    ("#### -5 + 0", "-5", 0.0),
    ("#### 18 #### 19", "19", 1.0),                            # two markers on a line: the last counts there too
    ("#### 7\n#### 8 #### 9", "9", 1.0),
    ("#### 2 * 3 * 4 = 24", "2", 0.0),                       # a spaced product is no emphasis: not 2 (was 1.0)
    ("#### 5 * 3 * 2", "5", 0.0),
    ("#### 10**3", "10", 0.0),                                # other ways to write a power or a product
    ("#### 2 ** 3", "2", 0.0),
    ("#### 3 x 4", "3", 0.0),
    ("#### 3·4", "3", 0.0),
    ("#### 7 1/2", "7", 0.0),                                 # a mixed number
    ("#### 18 ÷ 2", "18", 0.0),                               # a quotient, and the LaTeX spellings of the same
    ("\\boxed{3 \\times 4}", "3", 0.0),                         # operations, which \\boxed{} holds: a product
    ("\\boxed{3\\cdot4}", "3", 0.0),                             # (each of these read its first number, 1.0)
    ("\\boxed{3 \\ast 4}", "3", 0.0),
    ("\\boxed{18 \\div 2}", "18", 0.0),
    ("\\boxed{2^{10}}", "2", 0.0),                                # a power
    ("#### 2^-3", "2", 0.0),
    ("\\boxed{1\\frac{1}{2}}", "1", 0.0),                        # a mixed number, a fraction, a root
    ("\\boxed{3 \\over 4}", "3", 0.0),
    ("\\boxed{5\\sqrt{2}}", "5", 0.0),
    ("\\boxed{72^\\circ}", "72", 1.0),                            # a unit after the number is no operation
    ("\\boxed{72 \\text{ times}}", "72", 1.0),
    ("#### 1 000", "1", 0.0),                                 # a space between thousands: not 1,
    ("#### 1\u202f000", "1", 0.0),
    ("#### 3 4", "3", 0.0),                                   # two numbers, or 34 spaced: not 3 (was 1.0),
    ("#### 3 4", "34", 0.0),                                  # nor 34
    ("#### 12 00", "12", 0.0),
    ("\\boxed{3\n4}", "3", 0.0),
    ("#### 1,", "1", 0.0),                                    # "1,000" cut short by max_new_tokens
    ("#### 1, so it is", "1", 1.0),                           # a comma that ends a clause
    ("#### 3, 4", "3", 0.0),                                  # a list: not its first number (was 1.0)
    ("#### 3,  -4", "3", 0.0),
    ("#### 3:30", "3", 0.0),                                  # a time or a ratio: not 3 (was 1.0)
    ("\\boxed{2:1}", "2", 0.0),
    ("#### −18", "-18", 1.0),                                 # Unicode's minus as a sign
    ("\\boxed{−18}", "-18", 1.0),
    ("#### 1000000000", "1000000001", 0.0),                   # no tolerance: a near miss is a miss
    ("#### 10000000000000001", "10000000000000000", 0.0),     # even where both are the same float (was 1.0)
    ("#### 0.1000000000000000001", "0.1", 0.0),
    ("#### 10,000,000,000,000,001", 10000000000000001, 1.0),
    ("#### 0", "0.0000005", 0.0),
    ("#### 5", 5, 1.0),                                       # the answer as a number
    ("#### -3", "−3", 1.0),                                   # an answer with Unicode's minus (raised)
    ("#### −3", "−3", 1.0),
    ("##### 72", "72", 1.0),                                  # GSM8K's marker with more hashes (read none)
    ("###### 72", "72", 1.0),
    ("#####72", "72", 1.0),
    ("#### 18 ##### 19", "19", 1.0),
    ("#### 72 ####", "72", 1.0),                              # hashes that close the marker's line (markdown's
    ("#### 72 #####  \r\n", "72", 1.0),                       # closing run) are no new, empty marker (read none)
    ("#### 72\n####", "72", 0.0),                              # but hashes on a line of their own are
    ("##### 18 - 5", "18", 0.0),                              # still no number after the longer marker
    ("### 72", "72", 0.0),                                    # three hashes are a heading, no marker
    ("#### 72.", "72", 1.0),                                  # a sentence's full stop,
    ("#### $1,234", "1234", 1.0),                             # a dollar sign before thousands
    ("The answer is $72$.", "72", 0.0),                       # no marker, even in LaTeX's dollars
    ("\\boxed{\\mathbf{72}}", "72", 1.0),                     # LaTeX's other fonts (read none)
    ("\\boxed{\\boldsymbol{72}}", "72", 1.0),
    ("\\boxed{\\textit{72}}", "72", 1.0),
    ("\\boxed{\\mathbf{1{,}000}}", "1000", 1.0),
    ("\\boxed{-\\mathbf{72}}", "-72", 1.0),
    ("\\boxed{\\text{\\textbf{72}}}", "72", 1.0),             # one font inside another (read none)
    ("\\boxed{\\textbf{\\text{\\$}72}}", "72", 1.0),
    ("\\boxed{\\mathbf{3 \\times 4}}", "3", 0.0),             # an operation in bold is still one
    ("\\boxed{\\mathbf{3}\\frac{1}{2}}", "3", 0.0),
    ("\\boxed{\\mathbf{2^{10}}}", "2", 0.0),
    # cases each of which a mutation of the regexes alone passed (the mutation in brackets)
    ("\\boxed{1\\dfrac{1}{2}}", "1", 0.0),                     # \\dfrac, \\tfrac are fractions too ([dt]? dropped)
    ("\\boxed{1\\tfrac{1}{2}}", "1", 0.0),
    ("#### 1e-3", "1", 0.0),                                  # an exponent with its sign ([+-]? dropped)
    ("#### 1234,567", "1234567", 0.0),                        # commas after 1 to 3 digits only (\\d{1,4})
    ("\\boxed{1,}", "1", 0.0),                                # a closing comma inside the braces (the "}" kept)
    ("#### 3*4*", "34", 0.0),                                 # a product, not emphasis: after a digit (?<!\\d),
    ("#### *4*5", "45", 0.0),                                 # before one (?!\\d)
    ("\\boxed{\\textrm{72}}", "72", 1.0),                      # the fonts no case above reads (each dropped)
    ("\\boxed{\\mathit{72}}", "72", 1.0),
    ("\\boxed{\\bm{72}}", "72", 1.0),
    ("#### 72 ####\nthat is all", "72", 1.0),                 # closing hashes end a line, not only the text ((?m))
])
def test_numeric_reward_hand_cases(completion, answer, expected):
    assert numeric_reward(completion, answer) == expected


def test_an_answer_that_is_no_number_is_refused_whatever_the_completion():
    # it raised only once a completion had a readable final answer: 0.0 for the first steps of a run, then a crash
    for completion in ("#### 5", "no answer yet", "####"):
        with pytest.raises(ValueError, match="seventy"):
            numeric_reward(completion, "seventy")


def test_extract_answer():
    assert extract_answer("#### 1,234,567.25") == 1234567.25
    assert extract_answer("\\boxed{\\text{1{,}000}} apples") == 1000
    assert extract_answer("#### 1,5") is None and extract_answer("\\boxed{72") is None
    assert extract_answer("#### 1,2345") is None                       # not 1234 (nor 12345)
    assert extract_answer("The answer is 5") is None
    assert extract_answer("") is None


# ---------------------------------------------------------------- JSONL loading


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_load_jsonl_reads_both_shapes(tmp_path):
    path = write(tmp_path / "data.jsonl", [
        json.dumps({"question": "How many?", "answer": "3 * 360 = 1080\n#### 1,080"}),
        "",  # blank lines are skipped
        json.dumps({"prompt": "2 - 5 =", "answer": "-3", "id": 7}),  # extra keys are ignored
        json.dumps({"prompt": "5 / 2 =", "answer": "#### 2.50"}),
    ])
    first, second, third = load_jsonl(path)
    assert third == {"prompt": "5 / 2 =", "answer": "2.50"}
    assert first == {"prompt": "How many?\n" + tasks.ANSWER_INSTRUCTION, "answer": "1080"}
    assert second == {"prompt": "2 - 5 =", "answer": "-3"}


def test_a_final_answer_is_any_number_the_reward_reads(tmp_path):
    # ".5" and Unicode's minus ("−3") are numbers extract_answer reads in a completion (GSM8K writes neither: its
    # finals are integers such as "-3" or "1,080"); a data file holding them was refused as "not a number"
    path = write(tmp_path / "n.jsonl", [json.dumps({"prompt": "p", "answer": a}) for a in (".5", "#### −3", "−1,000.5")])
    assert [e["answer"] for e in load_jsonl(path)] == [".5", "-3", "-1000.5"]
    for example, completion in zip(load_jsonl(path), ("#### 0.5", "\\boxed{-3}", "#### −1,000.50")):
        assert numeric_reward(completion, example["answer"]) == 1.0


def test_the_number_after_the_last_hashes_is_the_answer(tmp_path):
    # a solution may write "####" more than once: the final answer is the number after the last one
    path = write(tmp_path / "two.jsonl", [json.dumps({"question": "q", "answer": "a #### 3\n#### 5"}),
                                          json.dumps({"prompt": "p", "answer": "#### 1 #### 2 #### 3"})])
    assert [e["answer"] for e in load_jsonl(path)] == ["5", "3"]


def test_prompt_wins_over_question_and_is_kept_as_written(tmp_path):
    # a line with both keys: "prompt" is used, as written, without ANSWER_INSTRUCTION (the question is ignored)
    path = write(tmp_path / "both.jsonl", [json.dumps({"question": "q?", "prompt": "p =", "answer": "1"}),
                                           json.dumps({"prompt": "p =", "question": "q?", "answer": "2"})])
    assert load_jsonl(path) == [{"prompt": "p =", "answer": "1"}, {"prompt": "p =", "answer": "2"}]


GOOD = json.dumps({"question": "q", "answer": "#### 1"})


@pytest.mark.parametrize("bad, reason", [
    ('{"question": "q", "answer": "#### 1"', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"answer": "#### 1"}', "missing key 'question'"),
    ('{"question": "q"}', "missing key 'answer'"),
    ('{"prompt": "q"}', "missing key 'answer'"),
    ('{"question": "q", "answer": [72]}', "'answer' must be a string"),
    ('{"question": "q", "answer": true}', "'answer' must be a string"),
    ('{"prompt": ["q"], "answer": "1"}', "'prompt' must be a string"),
    ('{"question": "q", "answer": "so it is\\n#### seventy"}', "not a number"),
    ('{"prompt": "q", "answer": ""}', "not a number"),
    ('{"question": "q", "answer": "#### 72 apples"}', "not a number"),
    ('{"question": "q", "answer": "#### 1,5"}', "not a number"),        # commas group three digits: not 15
    ('{"question": "q", "answer": "#### 12,34"}', "not a number"),
    ('{"question": "q", "answer": "#### 1,,0"}', "not a number"),
    ('{"question": "q", "answer": "#### 1234,567"}', "not a number"),  # a group of four before a comma
])
def test_malformed_line_names_file_and_line(tmp_path, bad, reason):
    path = write(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError) as error:
        load_jsonl(path)
    message = str(error.value)
    assert str(path) in message and "line 3" in message and reason in message


def test_a_numeric_answer_is_read_and_a_file_not_in_utf8_is_named(tmp_path):
    path = write(tmp_path / "n.jsonl", ['{"question": "q", "answer": 72}', '{"prompt": "p", "answer": -2.5}',
                                        '{"prompt": "p", "answer": 1e16}', '{"prompt": "p", "answer": 2.0}'])
    examples = load_jsonl(path)
    assert [e["answer"] for e in examples] == ["72", "-2.5", "10000000000000000", "2"]
    assert examples[0]["prompt"] == "q\n" + tasks.ANSWER_INSTRUCTION and examples[1]["prompt"] == "p"   # as any line
    # the line and the byte in it, counted by hand: `{"question": "caf` is 17 bytes, the latin-1 e-acute the 18th
    # (the file's offset was the decoder's chunk's: "byte 2837 of the file" for a bad byte 27413 bytes in)
    good = '{"question": "cafe?", "answer": "1"}\n' * 2000
    (tmp_path / "latin.jsonl").write_bytes((good + '{"question": "caf\u00e9?", "answer": "1"}').encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl, line 2001: not UTF-8 text \(byte 18 of the line\)$"):
        load_jsonl(tmp_path / "latin.jsonl")

@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_jsonl(path)


def test_missing_file_is_an_error(tmp_path):
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": no such data file"):
        load_jsonl(path)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + " is a folder, not a data file"):
        load_jsonl(tmp_path)


@pytest.mark.skipif(not GSM8K.is_dir(), reason="GSM8K is not in ../shared/data/gsm8k")
def test_gsm8k_loads_and_its_reference_solutions_score_1():
    path = GSM8K / "test.jsonl"
    examples = load_jsonl(path)
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(examples) == len(raw) == 1319
    assert examples[0]["answer"] == "18"  # Janet's ducks
    for example, record in zip(examples, raw):
        assert example["prompt"].startswith(record["question"])
        # The reference solution ends in "#### N", so the reward must give it full marks.
        assert numeric_reward(record["answer"], example["answer"]) == 1.0
        assert numeric_reward(record["answer"] + "\n#### 0.5", example["answer"]) == 0.0


# ---------------------------------------------------------------- arithmetic word questions

DATA = Path(__file__).resolve().parents[1] / "data"
# Each question's answer computed from its own words, independently of tasks.py's templates.
ARITHMETIC = [
    (r"\w+ has (\d+) \w+ and buys (\d+) more\. How many \w+ does \w+ have now\?", lambda a, b: a + b),
    (r"\w+ has (\d+) \w+ and gives (\d+) to a friend\. How many \w+ does \w+ have left\?", lambda a, b: a - b),
    (r"\w+ buys (\d+) bags with (\d+) \w+ in each bag\. How many \w+ does \w+ buy\?", lambda a, b: a * b),
    (r"\w+ has (\d+) \w+, buys (\d+) more, then gives away (\d+)\. How many \w+ does \w+ have now\?",
     lambda a, b, c: a + b - c),
    (r"\w+ buys (\d+) bags with (\d+) \w+ in each bag and finds (\d+) more\. How many \w+ does \w+ have now\?",
     lambda a, b, c: a * b + c),
]


def solve_arithmetic(prompt):
    """(the answer worked out from the question's words, the index of the kind of question)."""
    assert prompt.startswith(tasks.SHOTS) and prompt.endswith("\nAnswer:"), prompt
    question = prompt[len(tasks.SHOTS):].removeprefix("Question: ").removesuffix("\nAnswer:")
    for kind, (pattern, solve) in enumerate(ARITHMETIC):
        if match := re.fullmatch(pattern, question):
            return solve(*map(int, match.groups())), kind
    raise AssertionError(f"no known question: {question!r}")


def test_arithmetic_answers_match_the_words_of_each_question():
    examples = tasks.make_arithmetic(400, seed=3, top=9, two_step=0.3)
    kinds = []
    for example in examples:
        expected, kind = solve_arithmetic(example["prompt"])
        kinds.append(kind)
        solution, answer = example["answer"].split("\n#### ")
        assert int(answer) == expected > 0 and solution.endswith(f" = {expected}")
        assert numeric_reward(example["answer"], answer) == 1.0
        assert all(2 <= int(x) <= 9 for x in re.findall(r"\d+", example["prompt"][len(tasks.SHOTS):]))
    assert set(kinds) == set(range(len(ARITHMETIC)))                  # every kind of question occurs
    # two steps: drawn 30 % of the time, kept unless the answer is <= 0 (numbers 2..9, counted by enumeration)
    r = range(2, 10)
    one = (2 + sum(a > b for a in r for b in r) / 64) / 3             # a + b, a * b always; a - b if positive
    two = (1 + sum(a + b > c for a in r for b in r for c in r) / 512) / 2
    assert abs(sum(k >= 3 for k in kinds) / 400 - 0.3 * two / (0.3 * two + 0.7 * one)) < 0.06   # 0.355 vs 0.333
    assert {solve_arithmetic(e["prompt"])[1] for e in tasks.make_arithmetic(100, seed=3)} == {0, 1, 2}  # one step


def test_arithmetic_is_a_function_of_the_seed():
    assert tasks.make_arithmetic(50, seed=7) == tasks.make_arithmetic(50, seed=7)
    assert tasks.make_arithmetic(50, seed=7) != tasks.make_arithmetic(50, seed=8)
    assert tasks.make_arithmetic(10, seed=7) == tasks.make_arithmetic(50, seed=7)[:10]


def test_committed_arithmetic_files_are_the_generators_output(tmp_path):
    tasks.write_arithmetic(tmp_path)
    for name, size in (("train", 512), ("test", 64)):
        committed = (DATA / f"arithmetic_{name}.jsonl").read_text(encoding="utf-8")
        assert committed == (tmp_path / f"arithmetic_{name}.jsonl").read_text(encoding="utf-8")
        examples = load_jsonl(DATA / f"arithmetic_{name}.jsonl")
        assert len(examples) == size
        for example in examples:
            assert example["answer"] == str(solve_arithmetic(example["prompt"])[0])   # a plain integer
    train = {e["prompt"] for e in load_jsonl(DATA / "arithmetic_train.jsonl")}
    test = [e["prompt"] for e in load_jsonl(DATA / "arithmetic_test.jsonl")]
    assert len(test) == len(set(test)) and not train & set(test)     # held out: no training question


def test_arithmetic_refuses_what_it_cannot_make(tmp_path):
    with pytest.raises(ValueError, match="top >= 2"):
        tasks.make_arithmetic(5, seed=0, top=1)               # randint(2, 1): no number to draw
    with pytest.raises(ValueError, match="two_step in"):
        tasks.make_arithmetic(5, seed=0, two_step=1.5)
    # numbers 2..6 make 2160 distinct one-step questions: 3000 held-out ones do not exist
    with pytest.raises(ValueError, match="asked for test=3000"):
        tasks.write_arithmetic(tmp_path, test=3000)
    assert not list(tmp_path.iterdir())                        # refused before writing anything


def test_two_step_takes_the_whole_closed_range(tmp_path):
    # two_step=1.0 is allowed and gives two-step questions only (a check `two_step < 1.0` refused it), and a share
    # below 0 is refused (a check of the upper end alone let -0.5 through, as 0)
    assert {solve_arithmetic(e["prompt"])[1] for e in tasks.make_arithmetic(60, seed=0, two_step=1.0)} == {3, 4}
    with pytest.raises(ValueError, match="two_step in"):
        tasks.make_arithmetic(5, seed=0, two_step=-0.5)


def test_a_missing_file_of_that_data_set_says_where_to_get_it(tmp_path):
    # a GSM8K path names the README section that says where to get it; another path does not (the test's name,
    # which tmp_path holds, leaves "gsm8k" out)
    with pytest.raises(ValueError, match=r'gsm8k/test.jsonl: no such data file \(GSM8K: README "A real model on your'):
        load_jsonl(tmp_path / "gsm8k" / "test.jsonl")
    with pytest.raises(ValueError, match=r"other.jsonl: no such data file$"):
        load_jsonl(tmp_path / "other.jsonl")


def test_a_byte_order_mark_opening_a_data_file_is_read_past(tmp_path):
    # Windows editors (Notepad's "UTF-8 with BOM") open a file with U+FEFF: json.loads refused line 1 ("Unexpected
    # UTF-8 BOM"). It is read past there, as Python's "utf-8-sig" does; anywhere else it is a character of the line.
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "q", "answer": "#### 72"}\n{"prompt": "p", "answer": "3"}\n')
    assert load_jsonl(path) == [{"prompt": "q\n" + tasks.ANSWER_INSTRUCTION, "answer": "72"},
                                {"prompt": "p", "answer": "3"}]
    path.write_bytes(b'{"prompt": "p", "answer": "3"}\n\xef\xbb\xbf{"prompt": "p", "answer": "3"}\n')
    with pytest.raises(ValueError, match="bom.jsonl, line 2: not valid JSON"):
        load_jsonl(path)
