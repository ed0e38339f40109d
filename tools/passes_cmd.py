"""foldline passes: the registered graph passes, one line each, default pipeline marked."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("passes", help="list the graph passes and the default pipeline")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..passes.manager import available_passes, default_pipeline

    passes = available_passes()
    pipeline = default_pipeline()
    width = max((len(n) for n in passes), default=0)
    for name in pipeline + sorted(set(passes) - set(pipeline)):
        if name in pipeline:
            mark = f"[default {pipeline.index(name) + 1}]"
        else:
            mark = "[optional]"
        print(f"{name:<{width}}  {mark:<11}  {passes[name].description}")
    print(f"default pipeline: {' -> '.join(pipeline) if pipeline else '(none)'}")
    return 0
