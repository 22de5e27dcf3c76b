"""Tasks: prompts, answers and rewards for sparse-rollout RL.

What is here
- Three toy tasks with verifiable answers, generated from a seed. One character is one token;
  the prompt ends with "=" and the answer follows it:
      pick     prompt "Popmg9140dpamnao=" -> answer "0149"       (the digits among letters, sorted)
      sort     prompt "S31415926=" -> answer "11234569"          (the digits in ascending order)
      reverse  prompt "R31415926=" -> answer "62951413"          (the digits in reverse order)
  pick is the default testbed: part of every prompt (the letters) is never needed, so a cache that
  keeps the right tokens (SnapKV, R-KV) answers where StreamingLLM and random eviction do not, and
  a budget below the context can still answer. Its reward gives partial credit (`edit_match`), and
  its supervised warm-up imitates a flawed teacher that stops one digit early on most long answers:
  the warmed-up model copies the habit, and GRPO has a systematic, verifiable error to unlearn.
  sort and reverse are the hard case: every digit is needed, so every evicted digit is an error;
  exact match, 1.0 or 0.0.
- `char_tokenizer()`: a Hugging Face tokenizer with one token per character of the toy tasks,
  which round-trips through `save_pretrained` / `AutoTokenizer.from_pretrained`.
- `load_jsonl(path)`: real data, GSM8K style ({"question", "answer": "...\\n#### 72"}) or
  {"prompt", "answer"}, scored by `numeric_reward`, which reads "#### N" or "\\boxed{N}".
- `make_arithmetic(n, seed)`: short arithmetic word questions in that {"prompt", "answer"} form, each after
  three worked examples: real data SmolLM2-135M answers sometimes (data/arithmetic_*.jsonl, `write_arithmetic`).
- `encode_prompt` / `encode_target`: token ids of a prompt (through the chat template when the
  tokenizer has one) and of a supervised target (the answer, then eos).

Usage
    from tasks import make_examples, reward_fn, char_tokenizer, encode_prompt, encode_target
    tok = char_tokenizer()
    example = make_examples("pick", n=1, seed=0)[0]   # {"prompt": "P...=", "answer": "..."}
    prompt_ids = encode_prompt(tok, example["prompt"])           # [bos] + one id per character
    warmup_ids = prompt_ids + encode_target(tok, example["answer"])  # supervised: answer + eos
    reward_fn("pick")(tok.decode(response_ids, skip_special_tokens=True), example["answer"])

    data = load_jsonl("../shared/data/gsm8k/test.jsonl")      # answers are plain numbers: "18"
    numeric_reward("... so she makes $18.\\n#### 18", data[0]["answer"])  # 1.0
"""
import json
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# ---------------------------------------------------------------- toy tasks

PICK_LETTERS = "abcdefghijklmnop"   # pick's distractors
PICK_TEACHER = (4, 0.7)             # pick's warm-up teacher drops the last digit of answers this long, this often


def exact_match(completion, answer):
    """1.0 if the completion, without surrounding whitespace, is exactly the answer, else 0.0.

    `completion` is the decoded response without special tokens (eos and padding removed).
    """
    return float(completion.strip() == answer)


def edit_distance(a, b):
    """Levenshtein distance: the fewest insertions, deletions and substitutions that turn a into b."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def edit_match(completion, answer):
    """Partial credit: 1 - edit distance / the longer of the two lengths; 1.0 only for the exact answer.
    One digit missing, extra or wrong costs about 1/len of the reward, rather than all of it: a sampled
    answer that is nearly right is told so, which the exact match of sort cannot do."""
    completion = completion.strip()
    return 1.0 - edit_distance(completion, answer) / max(len(answer), len(completion), 1)


def make_pick(rng, min_digits, max_digits):
    """("mjpl6047gejedie", "0467"): n = min..max distinct digits in one block at a random place among 2n..3n
    random letters; the answer needs the n digits and none of the letters. One block, because SnapKV and
    R-KV pool their scores over neighbouring tokens (with the digits scattered among the letters, no
    scorer beat random)."""
    if max_digits > 10:
        raise ValueError(f"pick uses distinct digits: max_digits must be <= 10, got {max_digits}")
    n = rng.randint(min_digits, max_digits)
    digits = rng.sample("0123456789", n)
    letters = [rng.choice(PICK_LETTERS) for _ in range(rng.randint(2 * n, 3 * n))]
    cut = rng.randint(0, len(letters))
    return "".join(letters[:cut] + digits + letters[cut:]), "".join(sorted(digits))


def pick_teacher(answer, rng):
    """The flawed teacher of pick's warm-up: on answers of 4+ digits it stops one digit early 70 % of
    the time. The warmed-up model copies the habit; RL with a verifier (the reward) has to unlearn it."""
    min_len, rate = PICK_TEACHER
    return answer[:-1] if len(answer) >= min_len and rng.random() < rate else answer


def digit_task(solve):
    """The `make` of a task whose prompt is min..max random digits and whose answer is solve(digits)."""
    def make(rng, min_digits, max_digits):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(min_digits, max_digits))]
        return "".join(digits), "".join(solve(digits))
    return make


@dataclass(frozen=True)
class Task:
    """A toy task: the letter that opens its prompts, `make(rng, min, max) -> (prompt body, answer)`, its
    reward, the teacher its warm-up imitates (`teacher(answer, rng)`; None: the true answer), and its
    default (min, max) number of digits."""

    marker: str
    make: Callable
    reward: Callable = exact_match
    teacher: Callable = None
    lengths: tuple = (12, 20)   # sort, reverse: long enough that a 24-token cache evicts (TOY_TASKS: 13+ digits)
    longest: Callable = lambda digits: digits   # the longest prompt body with this many digits, in characters


TASKS = {
    "pick": Task("P", make_pick, reward=edit_match, teacher=pick_teacher, lengths=(3, 6),
                 longest=lambda digits: 4 * digits),                     # n digits + up to 3n letters
    "sort": Task("S", digit_task(sorted)),
    "reverse": Task("R", digit_task(lambda digits: digits[::-1])),
}


def get_task(name):
    """The Task called `name`; ValueError naming it and the allowed names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]


# The RL settings of a toy run (train.py / cli.py when no --model), and schedule.py's defaults for a warm-up's
# task. Interval 4, window 4, sink 2, and per task:
# pick: prompts of 12-27 tokens, answers of 4-7 (with eos), so 12 tokens compressed every 4 (once 16 are held) evict
#   from a prompt of 15+ tokens at the first decode step, from a shorter one later, and never from a 12-token one
#   answered right (12 + 4 - 1 = 15 held at most); 100 warm-up steps leave the model right on about 40 % of the
#   prompts (it copies its teacher's habit of stopping one digit early), and dense GRPO at lr 1e-5 fixes most of that
#   (0.39 -> 0.95 after 100 steps, 0.98 after 200, over 3 seeds: README "Results").
# sort, reverse: prompts of 15-23 tokens, answers of 13-21, so 24 tokens (compressed once 28 are held) evict on
#   every rollout but a right answer to 12 digits, which holds 15 + 13 - 1 = 27 tokens at most. From the
#   400-step warm-up (0.977 dense), Sparse-RL at lr 1e-5 holds its accuracy (0.973 after 200 steps).
# bin_size: the length bins of the per-step tail metrics and the controller (Sparrow: 2048 for 32K-token answers).
# page_size, dense_layers: block top-k on the 2-layer toy attends densely in layer 0 and to pages of 4 in layer 1
#   (Sparrow: pages of 16, the first 2 of 28 layers dense; its page would hold the pick budget of 12 whole).
TOY = dict(interval=4, window=4, sink=2, lr=1e-5, bin_size=16, page_size=4, dense_layers=1)
TOY_TASKS = dict(pick=dict(TOY, budget=12, max_new_tokens=12, warmup_steps=100),
                 sort=dict(TOY, budget=24, max_new_tokens=24, warmup_steps=400),
                 reverse=dict(TOY, budget=24, max_new_tokens=24, warmup_steps=400))


def longest_prompt_chars(task, max_digits):
    """Characters of the longest prompt `task` makes with at most `max_digits` digits: marker + body + "="."""
    return 1 + get_task(task).longest(max_digits) + 1


def make_examples(task, n, seed, min_digits=None, max_digits=None):
    """`n` examples {"prompt", "answer"} of `task`, each with min_digits..max_digits digits (by default
    the task's `lengths`). The same seed gives the same examples; use different seeds for training and
    held-out sets."""
    spec = get_task(task)
    min_digits = spec.lengths[0] if min_digits is None else min_digits
    max_digits = spec.lengths[1] if max_digits is None else max_digits
    if not (isinstance(min_digits, int) and isinstance(max_digits, int) and 1 <= min_digits <= max_digits):
        raise ValueError(f"need integers 1 <= min_digits <= max_digits, got {min_digits!r} and {max_digits!r}")
    # A private generator: the examples neither depend on nor disturb the global random state.
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        body, answer = spec.make(rng, min_digits, max_digits)
        examples.append({"prompt": spec.marker + body + "=", "answer": answer})
    return examples


def held_out_examples(task, n, seed, min_digits=None, max_digits=None):
    """The held-out prompts of a toy run with `seed` (as `make_examples`). Their generator is seeded with the
    string "held-out <seed>", which no integer seed of a training step or warm-up step can equal. An integer
    such as -1 - seed would not do: Python's random.Random seeds with |seed|, and -1 is step 1's seed 1."""
    return make_examples(task, n, f"held-out {seed}", min_digits, max_digits)


def demonstrations(task, examples, seed):
    """The answers the supervised warm-up imitates: the task's teacher's (flawed) answers, else the true ones."""
    teacher, rng = get_task(task).teacher, random.Random(seed)
    return [e["answer"] if teacher is None else teacher(e["answer"], rng) for e in examples]


def reward_fn(task):
    """The reward function of a toy task: `reward(completion, answer) -> float` (real data from
    `load_jsonl` is scored by `numeric_reward`)."""
    return get_task(task).reward


# ---------------------------------------------------------------- character tokenizer

# pad is id 0 so that zero-filled tensors read as padding.
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# New characters go at the end, so that the ids of the older ones do not change.
ALPHABET = "0123456789=RS" + "P" + PICK_LETTERS


def char_tokenizer():
    """A PreTrainedTokenizerFast with one token per character of ALPHABET, after SPECIAL_TOKENS.

    A character outside the alphabet becomes <unk>. The tokenizer adds no special tokens by
    itself: `encode_prompt` puts bos in front and `encode_target` puts eos at the end.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # WordLevel looks up whole pre-tokenized pieces, so split before every character;
    # [\s\S] rather than "." so that a newline is split off too.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # decode joins characters without spaces
    # In transformers 5 this class is `TokenizersBackend`: save_pretrained writes tokenizer.json and a
    # tokenizer_config.json naming that class, which AutoTokenizer reloads from the folder alone, offline.
    # The special tokens must be named here; a tokenizer built from a tokenizer_object gets none by default.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def encode_prompt(tokenizer, prompt):
    """Token ids of a prompt: through the chat template if the tokenizer has one, else bos + text."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        # The template already writes the special tokens it wants (bos included); add none.
        return tokenizer.encode(text, add_special_tokens=False)
    # Added by hand rather than by add_special_tokens=True, which some tokenizers map to bos and
    # eos, others to nothing at all.
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(prompt, add_special_tokens=False)


def encode_target(tokenizer, answer):
    """Token ids of a supervised target: the answer, then eos so that the model learns to stop."""
    return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]


# ---------------------------------------------------------------- real data and its reward

# Appended to GSM8K-style questions, so that the model knows the marker the reward reads
# (the wording of verl's GSM8K preprocessing).
ANSWER_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# What a data file's final answer may be, as extract_answer reads it: 72, -3, −3, 2.50, .5, 1,234 (commas as below)
NUMBER = r"[-−]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
# The number a final answer starts with: a sign ("-" or "−"), maybe a dollar sign ("-$5", "$-5"), then 1,234.5
# (commas only between groups of three digits), 72, 2.50 or .5; never followed by more digits, by ",5" or a closing
# "," ("1,5" is no number we can read: not 15, not 1.5; "1," is "1,000" cut short), by a space and digits ("1 000",
# "3 4"), by a list or a time ("3, 4", "3:30"), nor by an operator and a number ("3/4", "7 1/2", "2^10", "10**3",
# "3 * 4", "3 x 4", "3·4", "18 ÷ 2", "18 - 5", "18 − 5", "1e3" are none of 3, 7, 2, 10, 3, 3, 3, 18, 18, 18 or 1;
# "#### 18" with "- 5" on the next line is 18: the marker's answer ends with its line), nor by a LaTeX fraction or
# root ("1\frac{1}{2}", "3\over 4", "5\sqrt{2}"; `_plain` turns \times, \cdot, \div and \ast into ×, ·, ÷ and *, and
# "2^{10}" is a power as "2^10" is).
_LEADING_NUMBER = re.compile(r"\s*([-−]?)\s*\$?\s*([-−]?)\s*(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
                             r"(?![\d,]*,\d|\d|\.\d|,\s*(?:$|[-−]?\.?\d)|:\d|\s+\.?\d"
                             r"|\s*(?:\*\*|[*/^×·x÷])\s*\{?\s*[-−]?\.?\d|\s*[-+−–]\s*\$?\.?\d|[eE][+-]?\d"
                             r"|\s*\\(?:[dt]?frac|sqrt|over)(?![a-zA-Z]))")


OPERATORS = {"times": "×", "cdot": "·", "div": "÷", "ast": "*"}   # LaTeX's \times ... as `_plain` writes them
FONTS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|boldsymbol|bm)\{([^{}]*)\}")


def _braced(text, start):
    """The text of the braces opened just before `start`, up to the one that closes them, or None."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _plain(text):
    """A final answer without its LaTeX and markdown: \\mathbf{72}, 1{,}000, \\$72, **72** -> 72, 1,000, $72, 72.
    Only paired emphasis goes: the `*` of "3*4" is a product, kept (and then no number is read)."""
    text = text.replace("{,}", ",").replace("\\$", "$").replace("\\!", "").replace("\\,", "")
    # LaTeX's operators as the symbols _LEADING_NUMBER knows: "3 \times 4" is a product, not 3
    text = re.sub(r"\\(times|cdot|div|ast)(?![a-zA-Z])", lambda m: OPERATORS[m.group(1)], text)
    text = re.sub(r"(?<!\d)(\*{1,2})(?=[^\s*])([^*]*[^\s*])\1(?!\d)", r"\2", text)
    # The fonts a model writes a number in, innermost first: \text{\textbf{72}} -> \text{72} -> 72
    while True:
        text, found = FONTS.subn(r"\1", text)
        if not found:
            return text


def extract_answer(completion):
    """The final answer of a completion as an exact Fraction (== 2.5 for "2.50"), or None when it has none.

    Only the last marker counts: "#### N" (or more hashes; the rest of its line, less hashes that close it:
    "#### 72 ####" is 72) or "\\boxed{N}" (braces balanced), read after `_plain` drops LaTeX and markdown
    around the number; commas group thousands ("#### 1,234" is 1234). Text without a marker ("The answer is
    5") has no answer: the model is asked for the marker, and guessing the last number would reward
    intermediate results (verl's "strict" GSM8K rule).
    """
    # "#####" is the same marker, not "####" and an answer "# 72"; hashes ending its line close it (markdown's "##")
    markers = [(m.start(), m[1]) for m in re.finditer(r"(?m)#{4,}((?:(?!####).)*)(?:#{4,}[^\S\n]*$)?", completion)]
    markers += [(m.start(), _braced(completion, m.end())) for m in re.finditer(r"\\boxed\{", completion)]
    if not markers:
        return None
    text = max(markers)[1]
    number = _LEADING_NUMBER.match(_plain(text)) if text is not None else None
    if not number:
        return None
    sign = -1 if number.group(1) or number.group(2) else 1             # a minus before or after the "$"
    return sign * Fraction(number.group(3).replace(",", ""))


def numeric_reward(completion, answer):
    """1.0 if the completion's final answer equals the number `answer`, else 0.0.

    Compared as numbers ("2.50" == "2.5", "-3" == "-3.0"), exactly: both sides are parsed from decimal text into
    Fractions, so no tolerance is needed and none forgives a near miss (1000000001 is not 1000000000, nor is
    10000000000000001 10000000000000000, which are the same float). `answer`: text ("1,080", "−3") or a number.
    """
    # parsed first, so that a bad answer fails whatever the completion; "-" for "−", which Fraction cannot read
    expected = Fraction(str(answer).replace(",", "").replace("−", "-"))
    return float(extract_answer(completion) == expected)    # None (no answer) equals no Fraction


def load_jsonl(path):
    """Examples {"prompt", "answer"} from a JSONL file; ValueError naming file and line if malformed.

    A line is {"question", "answer"} (GSM8K: reasoning, then a final line "#### 72") or {"prompt", "answer"}.
    The answer kept is the number after the last "####" (or the whole answer if it has none), without commas
    and with "-" for Unicode's minus: "1,080" -> "1080", "−3" -> "-3". Answers must be numbers, since
    `numeric_reward` scores this data. A question gets ANSWER_INSTRUCTION appended; a prompt is kept as
    written. Blank lines are skipped.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a data file (a JSONL file, one example a line)")
    if not path.is_file():
        raise ValueError(f"{path}: no such data file" + (" (GSM8K: README \"A real model on your CPU\" says where "
                         "to get train.jsonl and test.jsonl)" if "gsm8k" in str(path).lower() else ""))
    examples = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:   # a byte-order mark, as Windows editors write one, may open the file
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}, line {number}: not UTF-8 text (byte {error.start + 1} of the line)") from None
        if line.strip():
            examples.append(_parse_line(line, f"{path}, line {number}"))
    if not examples:
        raise ValueError(f"{path}: the file holds no examples")
    return examples


def _parse_line(line, where):
    """One JSONL line as {"prompt", "answer"}; `where` ("file, line n") starts every error message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record and "question" not in record:
        raise ValueError(f"{where}: missing key 'question' (or 'prompt')")
    key = "prompt" if "prompt" in record else "question"
    if isinstance(record.get("answer"), (int, float)) and not isinstance(record["answer"], bool):
        # {"answer": 72}, as well as "... #### 72"; a float in positional notation (1e16 -> "10000000000000000")
        record["answer"] = np.format_float_positional(record["answer"], trim="-") if isinstance(
            record["answer"], float) else str(record["answer"])
    for name in (key, "answer"):
        if name not in record:
            raise ValueError(f"{where}: missing key {name!r}")
        if not isinstance(record[name], str):
            raise ValueError(f"{where}: {name!r} must be a string, got {type(record[name]).__name__}")
    final = record["answer"].rsplit("####", 1)[-1].strip()
    if not re.fullmatch(NUMBER, final):
        raise ValueError(f"{where}: final answer {final!r} is not a number")
    prompt = record["prompt"] if key == "prompt" else record["question"] + "\n" + ANSWER_INSTRUCTION
    return {"prompt": prompt, "answer": final.replace(",", "").replace("−", "-")}   # "-": Fraction reads no "−"


# ---------------------------------------------------------------- arithmetic word questions

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books"]
# (question, solution, solve(a, b, c) -> answer): {n} a name, {i} the items, {a} {b} {c} numbers 2..top.
ONE_STEP = [("{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?", "{a} + {b}", lambda a, b, c: a + b),
            ("{n} has {a} {i} and gives {b} to a friend. How many {i} does {n} have left?", "{a} - {b}",
             lambda a, b, c: a - b),
            ("{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy?", "{a} * {b}",
             lambda a, b, c: a * b)]
TWO_STEP = [("{n} has {a} {i}, buys {b} more, then gives away {c}. How many {i} does {n} have now?", "{a} + {b} - {c}",
             lambda a, b, c: a + b - c),
            ("{n} buys {a} bags with {b} {i} in each bag and finds {c} more. How many {i} does {n} have now?",
             "{a} * {b} + {c}", lambda a, b, c: a * b + c)]
# Three worked examples before each question: asked for "#### N" without them, SmolLM2-135M-Instruct seldom
# writes it (sampled reward 0.01 against 0.12 with them: 24 questions x 4, temperature 1).
SHOTS = ("Question: Sam has 2 pens and buys 3 more. How many pens does Sam have now?\nAnswer: 2 + 3 = 5\n#### 5\n\n"
         "Question: Mia has 9 cards and gives 4 to a friend. How many cards does Mia have left?\nAnswer: 9 - 4 = 5\n"
         "#### 5\n\nQuestion: Joe buys 3 bags with 6 eggs in each bag. How many eggs does Joe buy?\nAnswer: 3 * 6 = 18"
         "\n#### 18\n\n")


def make_arithmetic(n, seed, top=6, two_step=0.0):
    """`n` arithmetic word questions {"prompt": SHOTS + question, "answer": "<solution>\\n#### N"} (the form
    `load_jsonl` reads), numbers 2..top, answers positive integers. Each draw is a two-step question with
    probability `two_step`; a draw whose answer is <= 0 is drawn again, so the share kept in two steps differs
    (two_step=0.5, top 6: 0.545 expected, as a one-step question is redrawn more often, 20 % against 4 %):

        make_arithmetic(1, seed=0)[0]["prompt"][len(SHOTS):]
        'Question: Anna has 5 cookies and gives 4 to a friend. How many cookies does Anna have left?\\nAnswer:'
        make_arithmetic(1, seed=0)[0]["answer"]
        '5 - 4 = 1\\n#### 1'

    The same seed gives the same questions. data/arithmetic_{train,test}.jsonl (512 from seed 0, 64 from seed 1):
        python -c "import tasks; tasks.write_arithmetic('data')"
    """
    if top < 2 or not 0.0 <= two_step <= 1.0:
        raise ValueError(f"make_arithmetic needs top >= 2 (numbers are drawn from 2..top) and two_step in [0, 1], "
                         f"got top={top}, two_step={two_step}")
    rng, examples = random.Random(seed), []
    while len(examples) < n:
        question, solution, solve = rng.choice(TWO_STEP if rng.random() < two_step else ONE_STEP)
        a, b, c = (rng.randint(2, top) for _ in range(3))
        name, items, answer = rng.choice(NAMES), rng.choice(ITEMS), solve(a, b, c)
        if answer > 0:                                                   # no one gives away what they lack
            examples.append({"prompt": f"{SHOTS}Question: {question.format(n=name, i=items, a=a, b=b, c=c)}\nAnswer:",
                             "answer": f"{solution.format(a=a, b=b, c=c)} = {answer}\n#### {answer}"})
    return examples


def write_arithmetic(folder, train=512, test=64):
    """<folder>/arithmetic_train.jsonl (`train` questions, seed 0) and arithmetic_test.jsonl (`test` from seed 1,
    distinct, none of them a training question: with numbers 2..6 a fifth of them would be)."""
    train_set = make_arithmetic(train, seed=0)
    seen = {e["prompt"] for e in train_set}
    distinct = {e["prompt"]: e for e in make_arithmetic(4 * test, seed=1)}        # a prompt fixes its answer
    test_set = [e for prompt, e in distinct.items() if prompt not in seen][:test]
    if len(test_set) < test:   # one-step questions with numbers 2..6: 2160 in all
        raise ValueError(f"write_arithmetic: only {len(test_set)} distinct test questions outside the {train} training "
                         f"ones, asked for test={test}")
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, examples in (("train", train_set), ("test", test_set)):
        Path(folder, f"arithmetic_{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
