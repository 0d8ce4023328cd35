"""Zero-size tensors out of torch's CUDA sanitizer (``PYTHONPATH=scripts/csan``, used by
``scripts/gpu_checks.sh pipeline-checks``).

The sanitizer keys each tensor argument by its data pointer. A CUDA tensor with no elements has a
null pointer, so it is keyed by ``id(value)``, an address Python reuses once the object is freed:
two unrelated empty tensors made on two streams then read as one tensor, a "data race" that
stops the run (most likely what flagged torchrec's all-to-all output allocation, for torchrec's
pipeline and recpipe's alike). Under ``TORCH_CUDA_SANITIZER=1``:

- ``CSAN_NULL=skip`` leaves null-pointer tensors out (they own no memory, so they cannot race)
  and prints, per process at exit, how many arguments it left out;
- ``CSAN_NULL=log`` keeps them, notes the shapes seen under each ``id``, and prints them beside
  each report's pointer.

Python imports one ``sitecustomize``; this one first runs the next one on the path after its own
folder (the GPU kit's fbgemm aliases), once."""
import importlib.util
import os
import sys

_here, _after = os.path.realpath(os.path.dirname(__file__)), False
for _d in map(os.path.realpath, (d or "." for d in sys.path)):  # the next after this folder
    if _d == _here:
        _after = True
    elif _after and os.path.isfile(os.path.join(_d, "sitecustomize.py")):
        _f = os.path.join(_d, "sitecustomize.py")
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _f)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break

if os.environ.get("TORCH_CUDA_SANITIZER") and os.environ.get("CSAN_NULL"):
    import atexit

    import torch
    import torch.cuda._sanitizer as _csan

    _mode = os.environ["CSAN_NULL"]
    if _mode not in ("skip", "log"):
        sys.stderr.write(f"CSAN_NULL={_mode}: use CSAN_NULL=skip or CSAN_NULL=log\n")
        os._exit(2)  # sys.exit here is a fatal error of site, with a page of traceback
    _seen: dict[int, list] = {}
    _skipped = [0]
    _handle_argument = _csan.ArgumentHandler._handle_argument
    _handle_kernel_launch = _csan.EventHandler._handle_kernel_launch

    def _argument(self, value, is_write, metadata_only, name=None, is_output=False):
        if isinstance(value, torch.Tensor) and value.is_cuda and not value.data_ptr():
            if _mode == "skip":
                _skipped[0] += 1
                return
            shapes = _seen.setdefault(id(value), [])
            shapes.append((tuple(value.shape), str(value.dtype), name, "write" if is_write else "read"))
            del shapes[:-4]
        _handle_argument(self, value, is_write, metadata_only, name, is_output)

    def _kernel_launch(self, *args, **kwargs):
        errors = _handle_kernel_launch(self, *args, **kwargs)
        for e in errors:
            ptr = getattr(e, "data_ptr", 0)
            print(f"CSAN_NULL report ptr={ptr:#x} null-pointer tensors seen at that id: "
                  f"{_seen.get(ptr)}", file=sys.stderr, flush=True)
        return errors

    _csan.ArgumentHandler._handle_argument = _argument
    _csan.EventHandler._handle_kernel_launch = _kernel_launch
    if _mode == "skip":
        atexit.register(lambda: print(f"CSAN_NULL=skip pid {os.getpid()}: skipped {_skipped[0]} "
                                      "null-pointer tensor arguments", file=sys.stderr, flush=True))
