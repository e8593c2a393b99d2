"""The stages run after the passes, which are not rewrites: rolling loops
(`loops`), splitting a program into segments (`segments`) and host calls nested in
loops and branches (`nested`).

May import `.._compiler.jaxprs`, `_hostcalls` and everything below it."""
