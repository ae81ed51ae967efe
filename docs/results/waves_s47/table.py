import json, statistics
rows = [json.loads(l) for l in open('docs/results/waves_s47/rounds.jsonl')]
by = {}
for r in rows:
    by.setdefault(r['plan'], []).append(r)
idx = {"aep 5+3 a100-80g top1 cap 128/1024": 0, "aep 4+3 h100 top2 cap 256/1024": 1, "aep 4+4 h100 top1 cap 256/512": 2,
       "aep 4+4 a100-80g top2 cap 256/512": 3, "aep 6+2 h100 top1 cap 256/512": 4, "aep 5+3 h100 top2 cap 256/512": 5}
print("| plan (requests) | bound tok/s | two scrapes: runs → **mean** | counter's slope (fit): runs → mean | Little's law: runs → mean | rows an expert step | in flight (min) | errors |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
n2 = nf = nl = 0
for plan, rs in sorted(by.items(), key=lambda kv: idx[kv[0]]):
    v = [r['of_bound'] for r in rs]
    f = [r.get('fit_of_bound') for r in rs]
    l = [round(r['running_mean'] / (r['itl_ms'] / 1e3) / r['bound'], 3) for r in rs]
    m2 = statistics.mean(v); ff = [x for x in f if x]; mf = statistics.mean(ff) if ff else None; ml = statistics.mean(l)
    n2 += m2 >= 0.9; nf += bool(mf and mf >= 0.9); nl += ml >= 0.9
    err = sum((r.get('ended') or {}).get('error', 0) for r in rs)
    fs = ", ".join("–" if x is None else f"{x:.3f}" for x in f)
    print(f"| {idx[plan]} {plan} ({rs[0]['concurrency']}) | {rs[0]['bound']:,} | {', '.join(f'{x:.3f}' for x in v)} → **{m2:.3f}** | {fs} → {mf:.3f} | {', '.join(f'{x:.3f}' for x in l)} → {ml:.3f} | {', '.join(str(round(r['rows_per_step']['expert'])) for r in rs)} | {min(r['running_mean'] for r in rs):,.0f} | {err} |")
print(f"\nmeans >= 0.9: two scrapes {n2} of {len(by)}, fit {nf}, Little {nl}")
