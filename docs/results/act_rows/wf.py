"""Sum shared-memory wavefronts vs ideal over an ncu SASS source CSV; list instructions with excess."""
import csv, sys, io
for path in sys.argv[1:]:
    txt = open(path, errors="replace").read()
    i = txt.find('"Address"')
    if i < 0:
        i = txt.find('"#"')
    rows = list(csv.reader(io.StringIO(txt[max(i, 0):])))
    hdr = rows[0]
    def col(*must, notin=()):
        for j, h in enumerate(hdr):
            if all(m in h for m in must) and not any(n in h for n in notin):
                return j
        return None
    cw = col("Wavefronts Shared", notin=("Ideal", "Excessive"))
    ci = col("Wavefronts Shared Ideal")
    cs = col("Source")
    if cw is None or ci is None:
        print(path, "columns not found:", hdr[:60]); continue
    tw = ti = 0
    ex = []
    for r in rows[1:]:
        try:
            w = float(r[cw] or 0); idl = float(r[ci] or 0)
        except (ValueError, IndexError):
            continue
        tw += w; ti += idl
        if w > idl:
            ex.append((r[cs] if cs is not None else "?", w, idl))
    print(f"{path}: wavefronts {tw:.0f} ideal {ti:.0f} excess {100*(tw-ti)/max(tw,1):.1f}%")
    for s, w, idl in ex[:12]:
        print(f"    {s[:60]:60s} wf {w:.0f} ideal {idl:.0f}")
