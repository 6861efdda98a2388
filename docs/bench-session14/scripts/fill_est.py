import json, statistics
from duospec.draft_worker.suffix_trie import SuffixTrie, most_frequent
t = json.load(open("/tmp/ev/prof-run/replay-devices/target/replay.json"))
d = json.load(open("/tmp/ev/prof-run/replay-devices/draft/replay.json"))
def propose(trie, ctx, k, min_n=2):
    ctx = list(ctx); out = []
    for _ in range(k):
        depth, table = trie.longest_match(ctx, min_n)
        if not depth: break
        tok = most_frequent(table, by_recency=True); out.append(tok); ctx.append(tok)
    return out
for min_n in (1, 2, 3):
  acc_all, props, acc_rej = [], 0, []
  for e, de in zip(t["entries"], d["entries"]):
    seq = list(e["prompt"]); g = e["greedy"]
    trie = SuffixTrie(8); trie.extend(seq)
    for j in range(len(g)):
        full = seq + g[:j]
        p = propose(trie, full, 4, min_n)
        a = 0
        while a < len(p) and j + a < len(g) and p[a] == g[j + a]: a += 1
        if p: props += 1
        acc_all.append(a)
        dr = de["drafts"][j] if j < len(de["drafts"]) else []
        if dr and dr[0] != g[j]:  # the draft model is wrong here: where a rejection happens
            acc_rej.append(a)
        trie.add(seq + g, len(seq) + j)
  print(min_n, "positions", len(acc_all), "proposed share", round(props/len(acc_all),2), "mean accepted (all)", round(statistics.mean(acc_all),2), "after draft-miss", round(statistics.mean(acc_rej),2), len(acc_rej))
