"""The C API's Python side: libpyengine (cpp/capi) runs the engine through this package
(bridge.py takes its calls; host.py is one engine; options.py reads engine options)."""
