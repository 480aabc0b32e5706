// Python bindings for the mover backend: `worker._C`.
// torch/python.h, not torch/extension.h: the latter adds torch/all.h (the C++ frontend: nn, optim, data), which
// nothing here uses (this file's compile: 49 -> 34 s here; with -g as before, 75 s).
#include <torch/python.h>

#include "mover_backend.hpp"

namespace py = pybind11;
using tmover::MoverBackend;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The base type torch._C._distributed_c10d.Backend must be registered with pybind before we
  // derive from it; importing torch.distributed does that.
  py::module_::import("torch.distributed");

  m.doc() = "TrainMover mover backend: a c10d Backend wrapping a swappable inner backend.";

  py::class_<MoverBackend, c10d::Backend, c10::intrusive_ptr<MoverBackend>>(m, "MoverBackend", R"(
c10d backend "tmover" that forwards every op to an inner backend (gloo/NCCL) which can be
swapped between two ops (stage() then commit()). Modes: "live" forwards; "record" forwards,
waits, and keeps clones of every op's outputs; "replay" fills outputs from a loaded recording
with no inner backend; "bypass" completes barrier/send/recv at once and forwards the rest.)")
      .def(
          py::init([](int rank, int size, std::optional<c10::intrusive_ptr<c10d::Backend>> inner) {
            return c10::make_intrusive<MoverBackend>(rank, size, inner.value_or(nullptr));
          }),
          py::arg("rank"),
          py::arg("size"),
          py::arg("inner") = py::none(),
          "MoverBackend(rank, size, inner=None). Raises ValueError if inner's rank/size differ.")
      .def(
          "stage",
          &MoverBackend::stage,
          py::arg("inner"),
          py::call_guard<py::gil_scoped_release>(),
          "Hold `inner` (a Backend built elsewhere) for the next commit(); replaces any staged "
          "one. Raises ValueError if its rank/size differ from this backend's.")
      .def(
          "commit",
          &MoverBackend::commit,
          py::call_guard<py::gil_scoped_release>(),
          "Swap the staged backend in between two ops, clear the aborted state, and drop the "
          "old inner on a background thread. Returns the new generation (number of commits). "
          "Raises RuntimeError if nothing is staged.")
      .def(
          "discard_staged",
          &MoverBackend::discardStaged,
          py::call_guard<py::gil_scoped_release>(),
          "Drop the staged backend (in the background). Returns whether one was staged.")
      .def("has_staged", &MoverBackend::hasStaged, py::call_guard<py::gil_scoped_release>(), "Whether a backend is staged.")
      .def_property_readonly(
          "generation",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.generation();
          }, "Number of commits so far (int, starts at 0).")
      .def_property_readonly(
          "inner",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.currentInner();
          }, "The current inner Backend, or None.")
      .def(
          "set_mode",
          [](MoverBackend& self, const std::string& mode) {
            const auto parsed = tmover::parseMode(mode);
            py::gil_scoped_release nogil;
            self.setMode(parsed);
          },
          py::arg("mode"),
          "Set the mode: 'live', 'record', 'replay' or 'bypass'. Raises ValueError otherwise. "
          "Applies from the next op on.")
      .def_property_readonly(
          "mode",
          [](MoverBackend& self) {
            tmover::Mode mode;
            {
              py::gil_scoped_release nogil;
              mode = self.mode();
            }
            return std::string(tmover::modeName(mode));
          },
          "The current mode (str).")
      .def(
          "take_recording",
          &MoverBackend::takeRecording,
          py::call_guard<py::gil_scoped_release>(),
          "Return the recording as [(op_name, [outputs...]), ...] in call order and clear it. "
          "Raises RuntimeError if a recorded op is still in flight (nothing is cleared then) or "
          "if one failed (the recording is discarded).")
      .def(
          "load_recording",
          &MoverBackend::loadRecording,
          py::arg("recording"),
          py::call_guard<py::gil_scoped_release>(),
          "Set the replay source ([(op_name, [tensors...]), ...]) and rewind it to op #0.")
      .def(
          "seek_replay",
          &MoverBackend::seekReplay,
          py::arg("position"),
          py::call_guard<py::gil_scoped_release>(),
          "Make recorded op #position the next one replay consumes (a joiner skipping recorded ops it has no "
          "need to replay). Raises RuntimeError when position is outside 0..len(recording).")
      .def_property_readonly(
          "replay_position",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.replayPosition();
          },
          "Index of the next recorded op replay will consume (int).")
      .def_property_readonly(
          "recorded_ops",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.recordedOps();
          },
          "Ops recorded so far and not yet taken by take_recording (int; in flight ones included).")
      .def_property_readonly(
          "replay_remaining",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.replayRemaining();
          },
          "Recorded ops not yet consumed by replay (int).")
      .def(
          "abort",
          &MoverBackend::abortPending,
          py::arg("reason") = "abort() called",
          py::call_guard<py::gil_scoped_release>(),
          "Fail every pending work now (wait() raises RuntimeError with `reason`, futures get "
          "the error); the inner ops are abandoned. Later ops raise RuntimeError until commit(). "
          "Returns how many works were aborted.")
      .def(
          "fail",
          &MoverBackend::fail,
          py::arg("reason"),
          py::call_guard<py::gil_scoped_release>(),
          "Latch a failure (failure recovery): every pending work completes now, successfully, "
          "with its outputs as they are (a blocked wait() returns), and every later op completes "
          "at once without reaching the inner backend, until commit(). Returns how many works "
          "were released.")
      .def_property(
          "tolerant",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.tolerant();
          },
          [](MoverBackend& self, bool tolerant) {
            py::gil_scoped_release nogil;
            self.setTolerant(tolerant);
          },
          "When True, an inner op's error latches the failure (as fail() does) instead of "
          "raising from wait(): a DDP backward then finishes and the step is refused later.")
      .def_property_readonly(
          "failure",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.failure();
          },
          "The latched failure's reason (str), or None while not failed.")
      .def_property_readonly(
          "aborted",
          [](MoverBackend& self) {
            py::gil_scoped_release nogil;
            return self.aborted();
          }, "True between abort() and the next commit().")
      .def(
          "counters",
          [](MoverBackend& self) {
            tmover::Counters c;
            {
              // Never wait for the backend's mutex while holding the GIL: a thread holding that mutex
              // may need the GIL (dropping a tensor that has a Python object), which would deadlock.
              py::gil_scoped_release nogil;
              c = self.counters();
            }
            py::dict d;
            d["ops_issued"] = c.opsIssued;
            d["ops_completed"] = c.opsCompleted;
            d["ops_failed"] = c.opsFailed;
            d["pending"] = c.pending;
            d["last_op_start_s"] = c.lastOpStartS;
            d["last_op_end_s"] = c.lastOpEndS;
            d["busy_s"] = c.busyS;
            d["blocked_s"] = c.blockedS;
            d["generation"] = c.generation;
            d["ops_skipped"] = c.opsSkipped;
            d["failed"] = c.failed;
            d["mode"] = std::string(tmover::modeName(c.mode));
            return d;
          },
          "Counters as a dict: ops_issued, ops_completed, ops_failed, pending (ints; issued = "
          "completed + failed + pending), last_op_start_s / last_op_end_s (epoch seconds, 0.0 "
          "if none), busy_s (seconds, sum of issue->completion over completed ops), blocked_s "
          "(seconds callers spent in Work.wait()), generation (int), mode (str), ops_skipped (ops "
          "completed at once under the failure latch), failed (bool).");

  m.def(
      "release_in_background",
      &tmover::releaseInBackground,
      py::arg("backend"),
      py::call_guard<py::gil_scoped_release>(),
      "Drop `backend` on a detached thread once that thread holds its last reference (polls "
      "for up to ~60 s), so its destructor runs off the caller's thread and without the GIL. "
      "Delete your own references after calling this.");

  m.def(
      "wait_for_background",
      [](double timeoutS) {
        return tmover::waitForBackground(
            std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000.0)));
      },
      py::arg("timeout_s") = 10.0,
      py::call_guard<py::gil_scoped_release>(),
      "Wait up to `timeout_s` seconds until no background release is running and no op "
      "abandoned by abort() is still in flight in its inner backend. Returns True if so, "
      "False on timeout. Call before the interpreter exits: those threads may need the GIL.");
}
