package pdpolicy

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultPollInterval is how often a Watcher stats the policy file. The router agent
// writes the file atomically (temporary file, fsync, rename), so a poll sees the old file
// or the new one, never a half-written one; one second keeps a pushed policy in force
// within about a second at the cost of one stat(2) per second.
const DefaultPollInterval = time.Second

// Watcher keeps the last good policy of a file and swaps in each new valid version
// atomically. A file that is missing, unreadable, invalid or fails its checksum is
// refused: the last good policy stays in force and the refusal is counted (once per
// change of the file, not once per poll). A missing file is not a refusal: before the
// router agent's first push there is none.
type Watcher struct {
	path     string
	interval time.Duration
	current  atomic.Pointer[Policy]
	applied  atomic.Uint64
	refused  atomic.Uint64
	loadedAt atomic.Int64 // unix nanoseconds of the last swap, 0: none

	mu      sync.Mutex // serialises Poll
	seen    os.FileInfo
	lastErr error
}

// NewWatcher returns a watcher of path polling every interval (<= 0: DefaultPollInterval).
// It reads the file once before returning; a refused first file leaves no policy loaded
// (Decide then answers ReasonNoPolicy) and is reported by LastError.
func NewWatcher(path string, interval time.Duration) *Watcher {
	if interval <= 0 {
		interval = DefaultPollInterval
	}
	w := &Watcher{path: path, interval: interval}
	w.Poll()
	return w
}

// Policy returns the policy in force (nil: none loaded yet).
func (w *Watcher) Policy() *Policy { return w.current.Load() }

// Applied counts files swapped in; Refused counts files refused.
func (w *Watcher) Applied() uint64 { return w.applied.Load() }
func (w *Watcher) Refused() uint64 { return w.refused.Load() }

// LoadedAt is when the policy in force was swapped in (zero time: none).
func (w *Watcher) LoadedAt() time.Time {
	ns := w.loadedAt.Load()
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// LastError is why the latest changed file was refused (nil after a good one).
func (w *Watcher) LastError() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastErr
}

// Decide routes with the policy in force; with none, PrefillNode and ReasonNoPolicy (the
// router agent's answer before its first policy).
func (w *Watcher) Decide(f Features, draw func() float64) Decision {
	p := w.current.Load()
	if p == nil {
		return Decision{Route: PrefillNode, Reason: ReasonNoPolicy}
	}
	return p.Decide(f, draw)
}

// Poll checks the file once: when it changed (another inode, size or modification time)
// it is read, parsed and verified, then swapped in or refused. It reports whether a new
// policy was swapped in.
func (w *Watcher) Poll() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	info, err := os.Stat(w.path)
	if err != nil {
		// No file (not written yet, or removed): nothing to refuse; the policy in force stays.
		w.seen, w.lastErr = nil, err
		return false
	}
	if w.seen != nil && os.SameFile(w.seen, info) && w.seen.Size() == info.Size() &&
		w.seen.ModTime().Equal(info.ModTime()) {
		return false
	}
	w.seen = info
	data, err := os.ReadFile(w.path)
	if err != nil {
		w.refuse(err)
		return false
	}
	p, err := Parse(data)
	if err != nil {
		w.refuse(err)
		return false
	}
	if cur := w.current.Load(); cur != nil && cur.Version == p.Version &&
		cur.Checksum == p.Checksum {
		w.lastErr = nil // the same policy rewritten (or read twice across a rename)
		return false
	}
	w.current.Store(p)
	w.loadedAt.Store(time.Now().UnixNano())
	w.applied.Add(1)
	w.lastErr = nil
	return true
}

func (w *Watcher) refuse(err error) {
	w.refused.Add(1)
	w.lastErr = err
}

// Run polls every interval until ctx is done.
func (w *Watcher) Run(ctx context.Context) { w.RunUntil(ctx.Done()) }

// RunUntil polls every interval until stop is closed.
func (w *Watcher) RunUntil(stop <-chan struct{}) {
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			w.Poll()
		}
	}
}
