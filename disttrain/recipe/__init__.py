"""The recipe: what to train, checked before anything starts.

    schema.py    the YAML schema (pydantic), key.path=value overrides, {strategy}/{processes} in output.dir
    compat.py    what combines with what (strategy x LoRA/QLoRA x optimizer x trackers), one line per refusal
    matrix.py    every feature x every accelerate config: proven, refused or GPU-only (docs/compatibility.md)
    reference.py docs/recipes.md's field tables, rendered from the schema (`make docs`)
(What a mesh refuses lives with the mesh: disttrain/parallel/checks.py.)
"""
