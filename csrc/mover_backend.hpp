// MoverBackend: a c10d::Backend that forwards every collective to a swappable inner backend
// (gloo on CPU, NCCL on GPU clusters), so TrainMover can replace a rank's communicator under a
// live ProcessGroup (DDP, FSDP2, DeviceMesh, functional collectives keep their group object).
//
// It adds: a two-phase swap (stage a prebuilt inner, commit between two ops), record/replay of
// collective outputs, a bypass mode for barrier/p2p, abort of pending works, and counters.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tmover {

enum class Mode : uint8_t { kLive, kRecord, kReplay, kBypass };

const char* modeName(Mode mode);
Mode parseMode(const std::string& name); // throws c10::ValueError on an unknown name

// One recorded op: its name and clones of its outputs, filled in when the op completes.
struct RecordEntry {
  enum class Status : uint8_t { kInFlight, kDone, kFailed };
  std::string op;
  std::vector<at::Tensor> outputs;
  Status status = Status::kInFlight;
};

// Where a completing work writes clones of its outputs: a slot of the recording.
struct RecordTarget {
  int64_t slot;
  std::vector<at::Tensor> tensors;
};

// Snapshot of the counters (see MoverBackend::counters()).
struct Counters {
  uint64_t opsIssued = 0;
  uint64_t opsCompleted = 0;
  uint64_t opsFailed = 0;
  uint64_t pending = 0;
  double lastOpStartS = 0.0; // wall clock, epoch seconds
  double lastOpEndS = 0.0;
  double busyS = 0.0; // sum of issue -> completion over completed ops
  double blockedS = 0.0; // time callers spent inside MoverWork::wait()
  uint64_t opsSkipped = 0; // ops completed at once because the failure latch was set
  bool failed = false;
  int64_t generation = 0;
  Mode mode = Mode::kLive;
};

class MoverWork;

// Counts background activity that still touches communicators and tensors: releases running on
// their own thread and inner ops abandoned by abort(). Such a thread may drop the last reference
// to a tensor that Python created, which takes the GIL; at interpreter shutdown that aborts the
// process, so exit paths call waitForBackground() first (worker/backend.py does, at exit).
class BackgroundToken {
 public:
  BackgroundToken();
  ~BackgroundToken();
  BackgroundToken(const BackgroundToken&) = delete;
  BackgroundToken& operator=(const BackgroundToken&) = delete;
};

// True once no BackgroundToken is alive, false if `timeout` passed first.
bool waitForBackground(std::chrono::milliseconds timeout);

// Everything the backend and its works share. A MoverWork can outlive its backend (DDP keeps
// only the future), so this lives behind a shared_ptr. One mutex guards all of it: ops take it
// briefly to snapshot the inner backend, never while an inner op runs.
struct MoverState {
  std::mutex mu;
  c10::intrusive_ptr<c10d::Backend> inner;
  c10::intrusive_ptr<c10d::Backend> staged;
  int64_t generation = 0;
  Mode mode = Mode::kLive;
  bool aborted = false;
  std::string abortReason;
  // Failure latch (failure recovery): once set, every op completes at once with its outputs
  // untouched and never reaches the inner backend, until commit() swaps a new inner in. Set by
  // fail(), or by an inner op's error when `tolerant` (errors are then absorbed, not raised, so
  // a DDP backward finishes cleanly and the step is refused at the optimizer instead).
  bool tolerant = false;
  bool failed = false;
  std::string failReason;

  uint64_t nextWorkId = 0;
  std::unordered_map<uint64_t, c10::intrusive_ptr<MoverWork>> pending;
  // Per OpType: the current inner's works for this op type throw from getFuture() (gloo
  // send/recv), so we wait on a helper thread instead. Reset when a new inner is committed.
  std::array<bool, 128> innerLacksFuture{};

  Counters counters;

  std::vector<RecordEntry> recording;
  // Between startCoalescing() and endCoalescing(): ops' outputs are only final when the end
  // op's work completes (NCCL launches the group then), so their slots ride on that work.
  bool coalescing = false;
  std::vector<RecordTarget> coalescedTargets;
  std::vector<RecordEntry> replay;
  size_t replayPos = 0;

  // Called once per work when it completes or fails: counters, pending set, record slots
  // (`recorded` holds clones of the targets' tensors when `recordedOk`).
  void onSettled(
      uint64_t workId,
      bool ok,
      bool recordedOk,
      std::chrono::steady_clock::time_point start,
      std::vector<RecordTarget> recorded);
  void addBlocked(double seconds);
  // `error` unless this backend absorbs errors (tolerant): then latch the failure, return null.
  // An error from an op of an older generation (abandoned by fail(), completing late) latches
  // nothing: the inner it ran on is gone.
  std::exception_ptr absorb(std::exception_ptr error, int64_t opGeneration);
};

// The Work handed to callers. Owns its own future so that abort() can fail it while the inner
// op is still hung; a late inner completion is then ignored.
class MoverWork : public c10d::Work {
 public:
  MoverWork(
      int rank,
      c10d::OpType opType,
      std::string op,
      std::vector<at::Tensor> outputs,
      std::shared_ptr<MoverState> state,
      c10::intrusive_ptr<c10d::Work> inner,
      const c10::intrusive_ptr<c10::ivalue::Future>& innerFuture,
      std::vector<RecordTarget> recordTargets);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;
  void synchronize() override;
  void abort() override;

  // Called once the inner op finished (whether or not this work was still waiting for it).
  void onInnerDone();
  // abort(): this work was failed while its inner op still runs; keep the process from
  // exiting under it (see BackgroundToken) until the inner op ends.
  void markAbandoned();

  // First call wins; later calls (a late inner completion after abort) return false.
  // `value` is the future's value on success; nullopt means "the outputs as a tensor list".
  bool settle(
      std::exception_ptr error,
      std::optional<c10::IValue> value = std::nullopt,
      std::optional<std::vector<c10::ivalue::Future::WeakStorage>> storages = std::nullopt);

  uint64_t id() const {
    return id_;
  }
  void setId(uint64_t id) {
    id_ = id;
  }
  const std::vector<at::Tensor>& outputs() const {
    return outputs_;
  }
  const c10::intrusive_ptr<c10d::Work>& inner() const {
    return inner_;
  }
  const std::shared_ptr<MoverState>& state() const {
    return state_;
  }
  int64_t generation() const {
    return generation_;
  }
  void setGeneration(int64_t generation) {
    generation_ = generation;
  }
  const std::string& op() const {
    return op_;
  }
  bool hasRecordTargets() const {
    return !recordTargets_.empty();
  }

 private:
  const std::string op_;
  const std::vector<at::Tensor> outputs_;
  const std::shared_ptr<MoverState> state_;
  const c10::intrusive_ptr<c10d::Work> inner_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
  const std::vector<RecordTarget> recordTargets_;
  const std::chrono::steady_clock::time_point start_;
  uint64_t id_ = 0;
  int64_t generation_ = 0; // the mover's generation when the op was issued
  bool claimed_ = false; // guarded by mutex_; set by the first settle()
  bool innerDone_ = false; // guarded by mutex_
  std::unique_ptr<BackgroundToken> abandoned_; // guarded by mutex_
};

class MoverBackend : public c10d::Backend {
 public:
  MoverBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> inner = {});
  ~MoverBackend() override;

  // --- TrainMover control API ---
  void stage(c10::intrusive_ptr<c10d::Backend> inner);
  int64_t commit();
  bool discardStaged();
  bool hasStaged();
  int64_t generation();
  c10::intrusive_ptr<c10d::Backend> currentInner();
  void setMode(Mode mode);
  Mode mode();
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> takeRecording();
  void loadRecording(std::vector<std::pair<std::string, std::vector<at::Tensor>>> entries);
  int64_t replayPosition();
  int64_t replayRemaining();
  void seekReplay(int64_t position);
  // Ops recorded so far (in record mode; finished or in flight), not yet taken.
  int64_t recordedOps();
  int64_t abortPending(const std::string& reason);
  bool aborted();
  // Latch the failure and complete every pending work successfully (outputs as they are): a
  // caller blocked in wait() returns at once. Returns how many works were released.
  int64_t fail(const std::string& reason);
  void setTolerant(bool tolerant);
  bool tolerant();
  // The latched failure's reason, or nullopt when not failed.
  std::optional<std::string> failure();
  Counters counters();

  // --- c10d::Backend ---
  const std::string getBackendName() const override {
    return "tmover";
  }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsCoalescing() const override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void abort() override;
  void shutdown() override;
  void eagerConnectSingleDevice(at::Device device) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag)
      override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag)
      override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag)
      override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

 private:
  using IssueFn = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>;

  // The single op path: mode handling, inner snapshot, wrapping, recording.
  c10::intrusive_ptr<c10d::Work> run(
      c10d::OpType opType,
      const char* op,
      std::vector<at::Tensor> outputs,
      const IssueFn& issue);
  // A MoverWork around an issued inner work: pending until the inner completes (via its future,
  // or a helper thread where the inner has none).
  c10::intrusive_ptr<MoverWork> wrap(
      c10d::OpType opType,
      const char* op,
      std::vector<at::Tensor> outputs,
      const c10::intrusive_ptr<c10d::Work>& innerWork,
      bool lacksFuture,
      std::vector<RecordTarget> targets);
  // Under the state lock run `underLock` (it sets the aborted or failed latch) and take every
  // pending work; then settle each with `error` (null: success, outputs as they are) and mark its
  // inner op abandoned. Returns how many works this settled. abortPending() and fail() share it.
  int64_t releasePending(std::exception_ptr error, const std::function<void()>& underLock);
  // A MoverWork that completed already (replay, bypass, no inner work).
  c10::intrusive_ptr<MoverWork> completedWork(
      c10d::OpType opType,
      const char* op,
      std::vector<at::Tensor> outputs,
      std::vector<RecordTarget> targets = {});
  void replayInto(const char* op, const std::vector<at::Tensor>& outputs);
  c10::intrusive_ptr<c10d::Backend> requireInner();

  const std::shared_ptr<MoverState> state_;
  std::chrono::milliseconds timeout_ = kBackendDefaultTimeout;
};

// Drops `backend` on a detached thread once this is its last reference (polls, up to ~60 s),
// so that destroying a communicator (gloo: ~10 ms per peer, or until a hung op fails) never
// runs on the caller's thread or under the GIL.
void releaseInBackground(c10::intrusive_ptr<c10d::Backend> backend);

} // namespace tmover
