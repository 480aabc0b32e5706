#include "mover_backend.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <thread>

namespace tmover {

using c10d::OpType;
using c10d::Work;
using Clock = std::chrono::steady_clock;

namespace {

double wallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// "allreduce[float32(1024)]": the form divergence errors use.
std::string describe(const std::string& op, const std::vector<at::Tensor>& tensors) {
  std::ostringstream out;
  out << op << "[";
  const size_t shown = std::min<size_t>(tensors.size(), 4);
  for (size_t i = 0; i < shown; ++i) {
    const auto& t = tensors[i];
    out << (i ? ", " : "") << c10::getDtypeNames(t.scalar_type()).first << "(";
    for (int64_t d = 0; d < t.dim(); ++d) {
      out << (d ? ", " : "") << t.size(d);
    }
    out << ")";
  }
  if (tensors.size() > shown) {
    out << ", ... +" << tensors.size() - shown << " more";
  }
  out << "]";
  return out.str();
}

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) {
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return flat;
}

// Devices a future over these tensors must know about (CUDA stream sync); empty on CPU.
std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (t.defined() && !t.is_cpu() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

std::exception_ptr abortError(const std::string& reason) {
  return std::make_exception_ptr(c10::Error("mover backend aborted: " + reason));
}

bool isP2POrBarrier(OpType t) {
  return t == OpType::BARRIER || t == OpType::SEND || t == OpType::RECV ||
      t == OpType::RECVANYSOURCE;
}

// Barrier and send have no outputs worth keeping; a coalesced end has none of its own.
bool isRecorded(OpType t) {
  return t != OpType::BARRIER && t != OpType::SEND && t != OpType::COALESCED;
}

} // namespace

const char* modeName(Mode mode) {
  switch (mode) {
    case Mode::kLive:
      return "live";
    case Mode::kRecord:
      return "record";
    case Mode::kReplay:
      return "replay";
    case Mode::kBypass:
      return "bypass";
  }
  return "?";
}

Mode parseMode(const std::string& name) {
  for (Mode m : {Mode::kLive, Mode::kRecord, Mode::kReplay, Mode::kBypass}) {
    if (name == modeName(m)) {
      return m;
    }
  }
  TORCH_CHECK_VALUE(false, "unknown mover mode '", name, "' (live, record, replay, bypass)");
}

// ---------------------------------------------------------------------------------------------
// Background activity

namespace {
std::mutex gBackgroundMu;
std::condition_variable gBackgroundCv;
int64_t gBackgroundCount = 0;
} // namespace

BackgroundToken::BackgroundToken() {
  std::lock_guard<std::mutex> lock(gBackgroundMu);
  ++gBackgroundCount;
}

BackgroundToken::~BackgroundToken() {
  {
    std::lock_guard<std::mutex> lock(gBackgroundMu);
    --gBackgroundCount;
  }
  gBackgroundCv.notify_all();
}

bool waitForBackground(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(gBackgroundMu);
  return gBackgroundCv.wait_for(lock, timeout, [] { return gBackgroundCount == 0; });
}

// ---------------------------------------------------------------------------------------------
// MoverState

void MoverState::onSettled(
    uint64_t workId,
    bool ok,
    bool recordedOk,
    Clock::time_point start,
    std::vector<RecordTarget> recorded) {
  c10::intrusive_ptr<MoverWork> dropped; // released after the lock
  std::lock_guard<std::mutex> lock(mu);
  auto it = pending.find(workId);
  if (it != pending.end()) {
    dropped = std::move(it->second);
    pending.erase(it);
  }
  if (ok) {
    ++counters.opsCompleted;
    counters.busyS += secondsSince(start);
  } else {
    ++counters.opsFailed;
  }
  counters.lastOpEndS = wallNow();
  for (auto& target : recorded) {
    if (target.slot >= 0 && static_cast<size_t>(target.slot) < recording.size()) {
      auto& entry = recording[target.slot];
      entry.status = recordedOk ? RecordEntry::Status::kDone : RecordEntry::Status::kFailed;
      entry.outputs = std::move(target.tensors);
    }
  }
}

std::exception_ptr MoverState::absorb(std::exception_ptr error, int64_t opGeneration) {
  if (!error) {
    return error;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    if (tolerant && opGeneration != generation) {
      return nullptr; // a late error of an abandoned op: its work was settled already
    }
  }
  std::string what = "unknown error";
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  std::lock_guard<std::mutex> lock(mu);
  if (!tolerant) {
    return error;
  }
  if (!failed && opGeneration == generation) {
    failed = true;
    failReason = what;
  }
  return nullptr;
}

void MoverState::addBlocked(double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  counters.blockedS += seconds;
}

// ---------------------------------------------------------------------------------------------
// MoverWork

MoverWork::MoverWork(
    int rank,
    OpType opType,
    std::string op,
    std::vector<at::Tensor> outputs,
    std::shared_ptr<MoverState> state,
    c10::intrusive_ptr<Work> inner,
    const c10::intrusive_ptr<c10::ivalue::Future>& innerFuture,
    std::vector<RecordTarget> recordTargets)
    : Work(rank, opType),
      op_(std::move(op)),
      outputs_(std::move(outputs)),
      state_(std::move(state)),
      inner_(std::move(inner)),
      // Same element type and devices as the inner future, so DDP's comm hook (which reads
      // the value as a tensor list) and CUDA stream sync behave as with the inner backend.
      future_(
          innerFuture ? c10::make_intrusive<c10::ivalue::Future>(
                            innerFuture->elementType(), innerFuture->devices())
                      : c10::make_intrusive<c10::ivalue::Future>(
                            c10::ListType::ofTensors(), devicesOf(outputs_))),
      recordTargets_(std::move(recordTargets)),
      start_(Clock::now()) {}

bool MoverWork::settle(
    std::exception_ptr error,
    std::optional<c10::IValue> value,
    std::optional<std::vector<c10::ivalue::Future::WeakStorage>> storages) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (claimed_) {
      return false;
    }
    claimed_ = true;
  }
  // Fill the record slots before waking waiters: a caller whose wait() returned sees them.
  std::vector<RecordTarget> recorded;
  bool recordedOk = !error;
  try {
    for (const auto& target : recordTargets_) {
      recorded.push_back({target.slot, {}});
      for (const auto& t : target.tensors) {
        if (!error) {
          recorded.back().tensors.push_back(t.clone());
        }
      }
    }
  } catch (const std::exception&) {
    recordedOk = false; // e.g. out of memory: the op succeeded, its recording did not
  }
  state_->onSettled(id_, !error, recordedOk, start_, std::move(recorded));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_ = true;
    exception_ = error;
  }
  cv_.notify_all();
  if (error) {
    future_->setError(error);
  } else if (value.has_value()) {
    future_->markCompleted(std::move(*value), std::move(storages));
  } else {
    future_->markCompleted(c10::IValue(c10::List<at::Tensor>(outputs_)));
  }
  return true;
}

void MoverWork::onInnerDone() {
  std::unique_ptr<BackgroundToken> token; // released after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  innerDone_ = true;
  token = std::move(abandoned_);
}

void MoverWork::markAbandoned() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (inner_ && !innerDone_ && !abandoned_) {
    abandoned_ = std::make_unique<BackgroundToken>();
  }
}

bool MoverWork::wait(std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  bool done = true;
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [this] { return completed_; });
  } else {
    done = cv_.wait_for(lock, timeout, [this] { return completed_; });
  }
  const auto error = exception_;
  lock.unlock();
  state_->addBlocked(secondsSince(start));
  TORCH_CHECK(done, "mover ", op_, " did not complete within ", timeout.count(), " ms");
  if (error) {
    std::rethrow_exception(error);
  }
  // Completion came from the inner future; on NCCL this orders the caller's stream after the
  // collective (a no-op for gloo). Never call inner wait() here: gloo p2p works can only be
  // waited once.
  if (inner_) {
    inner_->synchronize();
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> MoverWork::getFuture() {
  return future_;
}

std::vector<at::Tensor> MoverWork::result() {
  return outputs_;
}

int MoverWork::sourceRank() const {
  TORCH_CHECK(inner_, "mover ", op_, ": no source rank (completed without an inner op)");
  return inner_->sourceRank();
}

void MoverWork::synchronize() {
  if (inner_) {
    inner_->synchronize();
  }
}

void MoverWork::abort() {
  if (settle(abortError("work " + op_ + " aborted"))) {
    markAbandoned();
  }
  if (inner_) {
    try {
      inner_->abort();
    } catch (const std::exception&) {
      // The inner is abandoned either way.
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MoverBackend: lifecycle and control

MoverBackend::MoverBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> inner)
    : Backend(rank, size), state_(std::make_shared<MoverState>()) {
  if (inner) {
    TORCH_CHECK_VALUE(
        inner->getRank() == rank && inner->getSize() == size,
        "inner backend is rank ",
        inner->getRank(),
        " of ",
        inner->getSize(),
        ", mover backend is rank ",
        rank,
        " of ",
        size);
  }
  state_->inner = std::move(inner);
  init();
}

MoverBackend::~MoverBackend() {
  abortPending("mover backend destroyed");
  c10::intrusive_ptr<c10d::Backend> inner, staged;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    inner = std::move(state_->inner);
    staged = std::move(state_->staged);
  }
  releaseInBackground(std::move(inner));
  releaseInBackground(std::move(staged));
}

void MoverBackend::stage(c10::intrusive_ptr<c10d::Backend> inner) {
  TORCH_CHECK_VALUE(inner, "stage() needs a backend, got None");
  TORCH_CHECK_VALUE(
      inner->getRank() == rank_ && inner->getSize() == size_,
      "staged backend is rank ",
      inner->getRank(),
      " of ",
      inner->getSize(),
      ", mover backend is rank ",
      rank_,
      " of ",
      size_);
  c10::intrusive_ptr<c10d::Backend> replaced;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    replaced = std::exchange(state_->staged, std::move(inner));
  }
  releaseInBackground(std::move(replaced));
}

int64_t MoverBackend::commit() {
  c10::intrusive_ptr<c10d::Backend> old;
  int64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    TORCH_CHECK(state_->staged, "commit() with nothing staged; call stage() first");
    old = std::exchange(state_->inner, std::move(state_->staged));
    state_->staged.reset();
    generation = ++state_->generation;
    state_->aborted = false;
    state_->abortReason.clear();
    state_->failed = false;
    state_->failReason.clear();
    state_->innerLacksFuture.fill(false);
  }
  releaseInBackground(std::move(old));
  return generation;
}

bool MoverBackend::discardStaged() {
  c10::intrusive_ptr<c10d::Backend> staged;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    staged = std::move(state_->staged);
  }
  const bool had = static_cast<bool>(staged);
  releaseInBackground(std::move(staged));
  return had;
}

bool MoverBackend::hasStaged() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<bool>(state_->staged);
}

int64_t MoverBackend::generation() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->generation;
}

c10::intrusive_ptr<c10d::Backend> MoverBackend::currentInner() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->inner;
}

void MoverBackend::setMode(Mode mode) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->mode = mode;
}

Mode MoverBackend::mode() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->mode;
}

std::vector<std::pair<std::string, std::vector<at::Tensor>>> MoverBackend::takeRecording() {
  std::vector<RecordEntry> entries;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    const auto inFlight = std::count_if(
        state_->recording.begin(), state_->recording.end(), [](const RecordEntry& e) {
          return e.status == RecordEntry::Status::kInFlight;
        });
    TORCH_CHECK(
        inFlight == 0,
        "take_recording(): ",
        inFlight,
        " recorded op(s) still in flight; wait() on them first");
    entries.swap(state_->recording);
  }
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> out;
  out.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    TORCH_CHECK(
        entries[i].status == RecordEntry::Status::kDone,
        "take_recording(): recorded op #",
        i,
        " (",
        entries[i].op,
        ") failed; the recording was discarded");
    out.emplace_back(std::move(entries[i].op), std::move(entries[i].outputs));
  }
  return out;
}

void MoverBackend::loadRecording(
    std::vector<std::pair<std::string, std::vector<at::Tensor>>> entries) {
  std::vector<RecordEntry> replay;
  replay.reserve(entries.size());
  for (auto& [op, outputs] : entries) {
    replay.push_back({std::move(op), std::move(outputs), RecordEntry::Status::kDone});
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->replay.swap(replay);
    state_->replayPos = 0;
  }
  // The old entries die here, outside the mutex: dropping a tensor may need the GIL.
}

int64_t MoverBackend::replayPosition() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int64_t>(state_->replayPos);
}

void MoverBackend::seekReplay(int64_t position) {
  std::lock_guard<std::mutex> lock(state_->mu);
  TORCH_CHECK(
      position >= 0 && static_cast<size_t>(position) <= state_->replay.size(),
      "replay position ",
      position,
      " is outside the recording (",
      state_->replay.size(),
      " ops)");
  state_->replayPos = static_cast<size_t>(position);
}

int64_t MoverBackend::replayRemaining() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int64_t>(state_->replay.size() - state_->replayPos);
}

int64_t MoverBackend::recordedOps() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return static_cast<int64_t>(state_->recording.size());
}

int64_t MoverBackend::abortPending(const std::string& reason) {
  // The inner ops are abandoned, not waited for: gloo's abort() cannot unblock them anyway.
  return releasePending(abortError(reason), [&] {
    state_->aborted = true;
    state_->abortReason = reason;
  });
}

int64_t MoverBackend::fail(const std::string& reason) {
  return releasePending(nullptr, [&] {
    if (!state_->failed) {
      state_->failed = true;
      state_->failReason = reason;
    }
  });
}

int64_t MoverBackend::releasePending(
    std::exception_ptr error,
    const std::function<void()>& underLock) {
  std::unordered_map<uint64_t, c10::intrusive_ptr<MoverWork>> victims;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    underLock();
    victims.swap(state_->pending);
  }
  int64_t count = 0;
  for (auto& entry : victims) {
    if (entry.second->settle(error)) {
      entry.second->markAbandoned();
      ++count;
    }
  }
  return count;
}

void MoverBackend::setTolerant(bool tolerant) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->tolerant = tolerant;
}

bool MoverBackend::tolerant() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->tolerant;
}

std::optional<std::string> MoverBackend::failure() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->failed) {
    return std::nullopt;
  }
  return state_->failReason;
}

bool MoverBackend::aborted() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->aborted;
}

Counters MoverBackend::counters() {
  std::lock_guard<std::mutex> lock(state_->mu);
  Counters c = state_->counters;
  c.pending = state_->pending.size();
  c.generation = state_->generation;
  c.failed = state_->failed;
  c.mode = state_->mode;
  return c;
}

// ---------------------------------------------------------------------------------------------
// MoverBackend: c10d::Backend plumbing

c10::intrusive_ptr<c10d::Backend> MoverBackend::requireInner() {
  auto inner = currentInner();
  TORCH_CHECK(inner, "mover backend has no inner backend; stage() and commit() one first");
  return inner;
}

c10::intrusive_ptr<c10d::Backend::Options> MoverBackend::getBackendOptions() {
  return c10::make_intrusive<Options>(getBackendName(), timeout_);
}

bool MoverBackend::supportsCoalescing() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->inner && state_->inner->supportsCoalescing();
}

void MoverBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  if (auto inner = currentInner()) {
    inner->setTimeout(timeout);
  }
}

void MoverBackend::startCoalescing() {
  if (mode() != Mode::kReplay) {
    requireInner()->startCoalescing();
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->coalescing = true;
}

c10::intrusive_ptr<Work> MoverBackend::endCoalescing() {
  // run() hands the block's record slots to this work (and clears the coalescing state).
  return run(OpType::COALESCED, "coalesced", {}, [](c10d::Backend& b) {
    return b.endCoalescing();
  });
}

void MoverBackend::abort() {
  abortPending("Backend.abort() called");
  if (auto inner = currentInner()) {
    inner->abort();
  }
}

void MoverBackend::shutdown() {
  if (auto inner = currentInner()) {
    inner->shutdown();
  }
}

void MoverBackend::eagerConnectSingleDevice(at::Device device) {
  if (auto inner = currentInner()) {
    inner->eagerConnectSingleDevice(device);
  }
}

void MoverBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  requireInner()->monitoredBarrier(opts, waitAllRanks);
}

// ---------------------------------------------------------------------------------------------
// MoverBackend: the op path

c10::intrusive_ptr<MoverWork> MoverBackend::completedWork(
    OpType opType,
    const char* op,
    std::vector<at::Tensor> outputs,
    std::vector<RecordTarget> targets) {
  auto work = c10::make_intrusive<MoverWork>(
      rank_, opType, op, std::move(outputs), state_, nullptr, nullptr, std::move(targets));
  work->settle(nullptr);
  return work;
}

void MoverBackend::replayInto(const char* op, const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> recorded;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    const size_t pos = state_->replayPos;
    TORCH_CHECK(
        pos < state_->replay.size(),
        "replay diverged at op #",
        pos,
        ": recording exhausted (",
        state_->replay.size(),
        " ops) but got ",
        describe(op, outputs));
    const auto& entry = state_->replay[pos];
    bool same = entry.op == op && entry.outputs.size() == outputs.size();
    for (size_t i = 0; same && i < outputs.size(); ++i) {
      same = entry.outputs[i].sizes() == outputs[i].sizes() &&
          entry.outputs[i].scalar_type() == outputs[i].scalar_type();
    }
    TORCH_CHECK(
        same,
        "replay diverged at op #",
        pos,
        ": recorded ",
        describe(entry.op, entry.outputs),
        " but got ",
        describe(op, outputs));
    recorded = entry.outputs;
    ++state_->replayPos;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    // Written into the caller's storage through a detached alias, as the network would: a receive buffer may be
    // a leaf that requires grad (pipelining's stage inputs), which autograd forbids an in-place copy_ into.
    at::Tensor dst = outputs[i].detach();
    dst.copy_(recorded[i]);
  }
}

c10::intrusive_ptr<Work> MoverBackend::run(
    OpType opType,
    const char* op,
    std::vector<at::Tensor> outputs,
    const IssueFn& issue) {
  const bool recorded = isRecorded(opType);
  Mode mode;
  c10::intrusive_ptr<c10d::Backend> inner;
  bool lacksFuture;
  bool inCoalescingBlock;
  std::vector<RecordTarget> targets; // record slots the returned work fills when it completes
  bool skip = false;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    TORCH_CHECK(!state_->aborted, "mover backend aborted: ", state_->abortReason);
    skip = state_->failed;
    mode = state_->mode;
    inner = state_->inner; // a commit() after this point affects the next op, not this one
    lacksFuture = state_->innerLacksFuture[static_cast<size_t>(opType) % 128];
    inCoalescingBlock = state_->coalescing;
    if (opType == OpType::COALESCED) { // endCoalescing(): the block's slots ride on this work
      targets.swap(state_->coalescedTargets);
      state_->coalescing = false;
    }
    ++state_->counters.opsIssued;
    state_->counters.lastOpStartS = wallNow();
    if (skip) {
      ++state_->counters.opsSkipped;
    }
  }
  if (skip) { // failure latched: this step is void anyway; never touch the broken inner
    return completedWork(opType, op, std::move(outputs));
  }
  int64_t slot = -1;
  // Ops that raise synchronously count as failed, so issued == completed + failed + pending.
  auto failIssue = [&] {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->counters.opsFailed;
    state_->counters.lastOpEndS = wallNow();
    targets.push_back({slot, {}});
    for (const auto& target : targets) {
      if (target.slot >= 0) {
        state_->recording[target.slot].status = RecordEntry::Status::kFailed;
      }
    }
  };

  if (mode == Mode::kReplay || (mode == Mode::kBypass && isP2POrBarrier(opType))) {
    if (mode == Mode::kReplay && recorded) {
      try {
        replayInto(op, outputs);
      } catch (...) {
        failIssue();
        throw;
      }
    }
    return completedWork(opType, op, std::move(outputs), std::move(targets));
  }

  c10::intrusive_ptr<Work> innerWork;
  try {
    TORCH_CHECK(inner, "mover backend has no inner backend; stage() and commit() one first");
    if (mode == Mode::kRecord && recorded) {
      std::lock_guard<std::mutex> lock(state_->mu);
      slot = static_cast<int64_t>(state_->recording.size());
      state_->recording.push_back({op, {}, RecordEntry::Status::kInFlight});
    }
    innerWork = issue(*inner);
  } catch (...) {
    failIssue();
    throw;
  }
  if (slot >= 0 && inCoalescingBlock) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->coalescedTargets.push_back({slot, outputs});
  } else if (slot >= 0) {
    targets.push_back({slot, outputs});
  }
  if (!innerWork) {
    // NCCL may return no work for an op inside a coalescing block; its end op carries it.
    return completedWork(opType, op, std::move(outputs), std::move(targets));
  }

  auto work = wrap(opType, op, std::move(outputs), innerWork, lacksFuture, std::move(targets));
  // Record mode waits so the recording is complete whenever the caller is between ops. recv
  // stays asynchronous: waiting there would deadlock irecv/isend pairs issued in that order.
  if (mode == Mode::kRecord && work->hasRecordTargets() && opType != OpType::RECV &&
      opType != OpType::RECVANYSOURCE) {
    work->wait();
  }
  return work;
}

c10::intrusive_ptr<MoverWork> MoverBackend::wrap(
    OpType opType,
    const char* op,
    std::vector<at::Tensor> outputs,
    const c10::intrusive_ptr<Work>& innerWork,
    bool lacksFuture,
    std::vector<RecordTarget> targets) {
  c10::intrusive_ptr<c10::ivalue::Future> innerFuture;
  if (!lacksFuture) {
    try {
      innerFuture = innerWork->getFuture();
    } catch (const std::exception&) {
      // gloo send/recv works have no future: remember, and wait on a helper thread instead.
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->innerLacksFuture[static_cast<size_t>(opType) % 128] = true;
    }
  }
  auto work = c10::make_intrusive<MoverWork>(
      rank_, opType, op, std::move(outputs), state_, innerWork, innerFuture, std::move(targets));

  // Registered as pending before completion is wired, so that abort() cannot miss it.
  std::string abortedWith;
  bool abortedNow = false;
  bool failedNow = false;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    work->setId(++state_->nextWorkId);
    work->setGeneration(state_->generation);
    abortedNow = state_->aborted;
    abortedWith = state_->abortReason;
    failedNow = state_->failed; // fail() ran after this op was issued
    if (!abortedNow && !failedNow) {
      state_->pending.emplace(work->id(), work);
    }
  }
  if (abortedNow && work->settle(abortError(abortedWith))) {
    work->markAbandoned();
  } else if (failedNow && work->settle(nullptr)) {
    work->markAbandoned();
  }

  if (innerFuture) {
    innerFuture->addCallback([work](c10::ivalue::Future& f) {
      if (f.hasError()) {
        work->settle(work->state()->absorb(f.exception_ptr(), work->generation()));
      } else {
        work->settle(nullptr, f.value(), f.storages());
      }
      work->onInnerDone();
    });
  } else {
    std::thread([work] {
      try {
        work->inner()->wait();
        work->settle(nullptr);
      } catch (...) {
        work->settle(work->state()->absorb(std::current_exception(), work->generation()));
      }
      work->onInnerDone();
    }).detach();
  }
  return work;
}

// ---------------------------------------------------------------------------------------------
// MoverBackend: ops. Each names its outputs (what record/replay keep) and how to issue it.

c10::intrusive_ptr<Work> MoverBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return run(OpType::BROADCAST, "broadcast", tensors, [&](c10d::Backend& b) {
    return b.broadcast(tensors, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run(OpType::ALLREDUCE, "allreduce", tensors, [&](c10d::Backend& b) {
    return b.allreduce(tensors, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return run(OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors, [&](c10d::Backend& b) {
    return b.allreduce_coalesced(tensors, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return run(OpType::REDUCE, "reduce", tensors, [&](c10d::Backend& b) {
    return b.reduce(tensors, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run(OpType::ALLGATHER, "allgather", flatten(outputs), [&](c10d::Backend& b) {
    return b.allgather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return run(OpType::_ALLGATHER_BASE, "_allgather_base", {output}, [&](c10d::Backend& b) {
    return b._allgather_base(output, input, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run(
      OpType::ALLGATHER_COALESCED, "allgather_coalesced", flatten(outputLists), [&](c10d::Backend& b) {
        return b.allgather_coalesced(outputLists, inputs, opts);
      });
}

c10::intrusive_ptr<Work> MoverBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run(
      OpType::ALLGATHER_COALESCED,
      "allgather_into_tensor_coalesced",
      outputs,
      [&](c10d::Backend& b) {
        return b.allgather_into_tensor_coalesced(outputs, inputs, opts);
      });
}

c10::intrusive_ptr<Work> MoverBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return run(OpType::GATHER, "gather", flatten(outputs), [&](c10d::Backend& b) {
    return b.gather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return run(OpType::SCATTER, "scatter", outputs, [&](c10d::Backend& b) {
    return b.scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run(OpType::REDUCE_SCATTER, "reduce_scatter", outputs, [&](c10d::Backend& b) {
    return b.reduce_scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return run(
      OpType::_REDUCE_SCATTER_BASE, "_reduce_scatter_base", {output}, [&](c10d::Backend& b) {
        return b._reduce_scatter_base(output, input, opts);
      });
}

c10::intrusive_ptr<Work> MoverBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run(
      OpType::REDUCE_SCATTER_TENSOR_COALESCED,
      "reduce_scatter_tensor_coalesced",
      outputs,
      [&](c10d::Backend& b) { return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
}

c10::intrusive_ptr<Work> MoverBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  return run(OpType::ALLTOALL_BASE, "alltoall_base", {output}, [&](c10d::Backend& b) {
    return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return run(OpType::ALLTOALL, "alltoall", outputs, [&](c10d::Backend& b) {
    return b.alltoall(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<Work> MoverBackend::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  return run(OpType::SEND, "send", tensors, [&](c10d::Backend& b) {
    return b.send(tensors, dstRank, tag);
  });
}

c10::intrusive_ptr<Work> MoverBackend::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  return run(OpType::RECV, "recv", tensors, [&](c10d::Backend& b) {
    return b.recv(tensors, srcRank, tag);
  });
}

c10::intrusive_ptr<Work> MoverBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return run(OpType::RECVANYSOURCE, "recvAnysource", tensors, [&](c10d::Backend& b) {
    return b.recvAnysource(tensors, tag);
  });
}

c10::intrusive_ptr<Work> MoverBackend::barrier(const c10d::BarrierOptions& opts) {
  return run(OpType::BARRIER, "barrier", {}, [&](c10d::Backend& b) { return b.barrier(opts); });
}

// ---------------------------------------------------------------------------------------------

void releaseInBackground(c10::intrusive_ptr<c10d::Backend> backend) {
  if (!backend) {
    return;
  }
  // Taken before the thread starts so that waitForBackground() cannot miss this release.
  auto token = std::make_unique<BackgroundToken>();
  std::thread([backend = std::move(backend), token = std::move(token)]() mutable {
    if (backend.use_count() > 1) {
      // Others (e.g. a Python variable) still hold it: wait until ours is the last reference
      // so that the destructor runs here; past the bound, the last holder destroys it. Not
      // counted as background work meanwhile: nothing of ours runs until they let go.
      token.reset();
      const auto deadline = Clock::now() + std::chrono::seconds(60);
      while (backend.use_count() > 1 && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      token = std::make_unique<BackgroundToken>();
    }
    backend.reset();
    token.reset();
  }).detach();
}

} // namespace tmover
