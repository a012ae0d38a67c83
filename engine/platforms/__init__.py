"""Device platforms: each device's fast paths behind one object the model runner calls.

`engine.platforms.select.platform_for` gives the CPU platform (engine.platforms.cpu) on the CPU
and the do-nothing `Platform` (engine.platforms.base) on every other device; the runner asks it
for the "auto" dtype, lets it `prepare` the loaded model, and runs each step's forward inside
its `step`.

Nothing is imported here: a CPU worker imports `engine.platforms.cpu.runtime` before it
re-executes itself under the tuned runtime and before its engine thread exists, and loading
torch (and with it OpenMP, which binds the loading thread) on the event loop's thread then
would leave the engine's threads sharing a core.
"""
