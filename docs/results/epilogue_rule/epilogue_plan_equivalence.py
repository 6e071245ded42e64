# Exhaustive check: the tiled range kernel's boundary-tile epilogue, old (64-bit divisions) vs new (bounds), make the
# same decisions: which warp stores which tile of which side, summing which warps' partials in which order.
def plan(n, NW, IPT, new):
    rb = lambda w: n * w // NW
    out = []
    for warp in range(NW):
        u0, u1 = rb(warp), rb(warp + 1)
        tf = u0 // IPT if u0 < u1 else -1
        tl = (u1 - 1) // IPT if u0 < u1 else -1
        if u0 >= u1:
            continue
        for side in range(2):
            t = tl if side else tf
            if side == 1 and tl == tf:
                break
            if side == 0:
                earlier = False
                for w2 in range(warp - 1, -1, -1):
                    b0, b1 = rb(w2), rb(w2 + 1)
                    if b0 < b1:
                        earlier = (b1 > t * IPT) if new else ((b1 - 1) // IPT == t)
                        break
                if earlier:
                    continue
            summed = [(warp, side)]
            if new:
                wend = warp + 1
                while wend < NW and rb(wend) < (t + 1) * IPT:
                    wend += 1
                for w2 in range(warp + 1, wend):
                    if rb(w2) == rb(w2 + 1):
                        continue
                    summed.append((w2, 0))
            else:
                for w2 in range(warp + 1, NW):
                    b0, b1 = rb(w2), rb(w2 + 1)
                    if b0 >= b1:
                        continue
                    if b0 // IPT != t:
                        break
                    summed.append((w2, 0))
            out.append((t, tuple(summed)))
    return out

cases = 0
for NW in (8, 16):
    for IPT in range(1, 130):
        for tiles in range(1, 40):
            n = tiles * IPT
            a, b = plan(n, NW, IPT, False), plan(n, NW, IPT, True)
            assert a == b, (NW, IPT, tiles)
            # every tile stored exactly once, and every warp's partials used exactly once
            assert sorted(t for t, _ in a) == sorted(set(t for t, _ in a)), (NW, IPT, tiles)
            cases += 1
print("identical plans in", cases, "cases")
