"""A literal transcription of the public decontamination rule, the reference `tests/test_decontam.py` and
`benchmarks/bench_decontam.py` check ours against: swiss-ai/posttraining-data, 04-decontamination/decontamination.py
(functions `get_ngrams`, `get_eval_match_indices`, `check_matching`; the main loop's per-pair test), with its
multiprocessing globals made arguments and nothing else changed — the off-by-one in `get_ngrams` included."""
import difflib
from collections import defaultdict


def get_ngrams(tokens, n):
    """Generate n-grams from tokens."""
    return set(zip(*[tokens[i:-(n-i)] for i in range(n)]))


def process_tokens(x, ngram_length):
    return {
        "ngram": get_ngrams(x, ngram_length),
        "tokens": x
    }


def build_index(eval_ngrams):
    eval_ngram_to_eval_idx = defaultdict(list)
    append = eval_ngram_to_eval_idx.__getitem__
    for idx, s in enumerate(eval_ngrams):
        for element in s["ngram"]:
            append(element).append(idx)
    return eval_ngram_to_eval_idx, set(eval_ngram_to_eval_idx.keys())   # the script's initializer keeps both


def get_eval_match_indices(train_sample, eval_ngram_to_eval_idx, eval_ngram_to_eval_idx_key_set):
    shared_ngrams = train_sample["ngram"] & eval_ngram_to_eval_idx_key_set
    if len(shared_ngrams) == 0:
        return tuple([])
    matches = []
    for ngram in shared_ngrams:
        matches.extend(eval_ngram_to_eval_idx.get(ngram))
    return tuple(set(matches))


def check_matching(train_sample, eval_indices, eval_ngrams, diff_threshold=0.5):
    eval_idx_match = None
    for eval_idx in eval_indices:
        matcher = difflib.SequenceMatcher(
            None,
            train_sample["tokens"],
            eval_ngrams[eval_idx]["tokens"],
            autojunk=False
        )
        matching_blocks = matcher.get_matching_blocks()
        match_length = sum([x.size if x.size >= 5 else 0 for x in matching_blocks])
        del matcher, matching_blocks
        if match_length / len(eval_ngrams[eval_idx]["tokens"]) >= diff_threshold:
            eval_idx_match = eval_idx
            break
    return eval_idx_match


def decontaminate(train_tokens, eval_tokens, ngram_length=8, diff_threshold=0.5):
    "The script's pipeline on token lists: for each training sample, the matching benchmark index or None."
    train_ngrams = [process_tokens(x, ngram_length) for x in train_tokens]
    eval_ngrams = [process_tokens(x, ngram_length) for x in eval_tokens]
    index, keys = build_index(eval_ngrams)
    return [check_matching(t, get_eval_match_indices(t, index, keys), eval_ngrams, diff_threshold) for t in train_ngrams]
