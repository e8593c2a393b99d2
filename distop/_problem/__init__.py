"""The `Problem` facade (`problem`), its arguments (`arguments`), the running of its
programs (`execution`) and its inputs (`inputs`).

The top layer: may import every other."""
