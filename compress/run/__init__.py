"""Running described work: the recipe schema and its validation (`recipe`), the runner that turns a recipe
into engine stages, output, evaluation and export (`runner`), the distillation recipe (`distill`), a
recipe's calibrated KV-cache scales (`kv_cache`), and the resumable grid of recipes behind `compress sweep`
(`sweep`).

May import `compress.export`, `compress.engine`, `compress.eval`, `compress.distill`,
`compress.checkpoints`, the algorithm packages and `compress.errors`; only `compress.cli` imports it.
"""
