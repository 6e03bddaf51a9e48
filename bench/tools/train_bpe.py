#!/usr/bin/env python3
"""Trains a large byte-level BPE for the tokenizer benchmark, without HF tokenizers.

The fixture tokenizers (tests/fixtures/tokenizers) have ~900 tokens; real Qwen2.5 / LLaMA-3
vocabularies have 128k-152k, so words merge much further. This script learns MERGES merges
from the benchmark corpus (classic BPE on word counts, updated incrementally) and writes a
copy of a fixture's tokenizer.json with that vocabulary, the fixture's pipeline and its added
tokens renumbered after the vocabulary:

  bench/tools/train_bpe.py CORPUS.jsonl FIXTURE_DIR OUT_DIR [MERGES=32000] [SAMPLE_MB=20]

Words are cut with a simple approximation of the split pattern; the merges only need to be
plausible, the tokenizer under test applies the file's own pre-tokenizer.
"""
import collections, heapq, json, os, re, shutil, sys


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main():
    corpus, fixture, out = sys.argv[1:4]
    n_merges = int(sys.argv[4]) if len(sys.argv) > 4 else 32000
    sample = int(float(sys.argv[5] if len(sys.argv) > 5 else 20) * 1e6)
    byte_char = bytes_to_unicode()
    split = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+", re.UNICODE)
    counts = collections.Counter()
    read = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            read += len(line)
            if read > sample:
                break
            for w in split.findall(json.loads(line)["text"]):
                counts["".join(byte_char[b] for b in w.encode("utf-8"))] += 1
    words = [list(w) for w in counts]
    freq = [counts[w] for w in counts]
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_count[a, b] += freq[i]
            where[a, b].add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    vocab = {byte_char[b]: None for b in range(256)}
    merges = []
    while len(merges) < n_merges and heap:
        c, pair = heapq.heappop(heap)
        if -c != pair_count.get(pair, 0) or -c < 2:
            if pair_count.get(pair, 0) >= 2 and -c != pair_count[pair]:
                heapq.heappush(heap, (-pair_count[pair], pair))
            continue
        a, b = pair
        new = a + b
        merges.append(f"{a} {b}")
        vocab[new] = None
        changed = set()
        for i in list(where.pop(pair, ())):
            w = words[i]
            for x, y in zip(w, w[1:]):
                pair_count[x, y] -= freq[i]
                changed.add((x, y))
            j, merged = 0, []
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(w[j])
                    j += 1
            words[i] = merged
            for x, y in zip(merged, merged[1:]):
                pair_count[x, y] += freq[i]
                where[x, y].add(i)
                changed.add((x, y))
        pair_count.pop(pair, None)
        for p in changed:
            if pair_count.get(p, 0) >= 2:
                heapq.heappush(heap, (-pair_count[p], p))
    spec = json.load(open(os.path.join(fixture, "tokenizer.json"), encoding="utf-8"))
    ids = {t: i for i, t in enumerate(vocab)}
    for i, tok in enumerate(spec.get("added_tokens", [])):
        tok["id"] = len(ids) + i
    spec["model"]["vocab"] = ids
    spec["model"]["merges"] = merges
    os.makedirs(out, exist_ok=True)
    json.dump(spec, open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8"),
              ensure_ascii=False)
    for name in ("tokenizer_config.json",):
        if os.path.exists(os.path.join(fixture, name)):
            shutil.copy(os.path.join(fixture, name), os.path.join(out, name))
    print(f"{out}: {len(ids)} tokens, {len(merges)} merges from {len(words)} distinct words")


if __name__ == "__main__":
    main()
