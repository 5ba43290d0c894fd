package pdpolicy

import (
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"
)

// writeAtomic replaces path like the router agent does (temporary file, rename).
func writeAtomic(t *testing.T, path string, data []byte) {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func withVersion(t *testing.T, v int) []byte {
	return edit(t, "version", strconv.Itoa(v))
}

func TestWatcherSwapsAndKeepsTheLastGoodPolicy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.json")
	w := NewWatcher(path, 0)
	if w.Policy() != nil || w.Refused() != 0 {
		t.Fatalf("no file: policy %v, refused %d", w.Policy(), w.Refused())
	}
	if d := w.Decide(Features{Turn: 2, AppendTokens: 1, ExpectedOutputTokens: 1}, nil); d.Reason != ReasonNoPolicy ||
		d.Route != PrefillNode {
		t.Fatalf("no policy: %+v", d)
	}
	writeAtomic(t, path, withVersion(t, 42))
	if !w.Poll() || w.Policy().Version != 42 || w.Applied() != 1 {
		t.Fatalf("v42 not applied: %v", w.LastError())
	}
	if w.Poll() {
		t.Fatal("an unchanged file was applied again")
	}
	// A tampered file (scores edited, checksum kept) and a truncated one: refused once each.
	writeAtomic(t, path, edit(t, "scores", "[0.5, 0.0]"))
	if w.Poll() || w.Policy().Version != 42 || w.Refused() != 1 || w.LastError() == nil {
		t.Fatalf("bad checksum: version %d refused %d", w.Policy().Version, w.Refused())
	}
	w.Poll()
	if w.Refused() != 1 {
		t.Fatalf("the same bad file counted %d times", w.Refused())
	}
	writeAtomic(t, path, withVersion(t, 43)[:40])
	if w.Poll() || w.Policy().Version != 42 || w.Refused() != 2 {
		t.Fatalf("truncated file: version %d refused %d", w.Policy().Version, w.Refused())
	}
	os.Remove(path)
	if w.Poll() || w.Policy().Version != 42 || w.Refused() != 2 {
		t.Fatalf("removed file: version %d refused %d", w.Policy().Version, w.Refused())
	}
	writeAtomic(t, path, withVersion(t, 44))
	if !w.Poll() || w.Policy().Version != 44 || w.Applied() != 2 || w.LastError() != nil {
		t.Fatalf("v44 not applied: %v", w.LastError())
	}
}

func TestWatcherRunSwapsUnderConcurrentDecisions(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.json")
	writeAtomic(t, path, withVersion(t, 1))
	w := NewWatcher(path, 5*time.Millisecond)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { w.RunUntil(stop); close(done) }()
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f := Features{Turn: 2, ContextTokens: 100, AppendTokens: 100, ExpectedOutputTokens: 10}
			for i := 0; i < 20000; i++ {
				if d := w.Decide(f, func() float64 { return 0.5 }); d.Reason != ReasonTable {
					t.Errorf("decision %+v", d)
					return
				}
			}
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for v := 2; v <= 5; v++ {
		writeAtomic(t, path, withVersion(t, v))
		for w.Policy().Version != int64(v) {
			if time.Now().After(deadline) {
				t.Fatalf("v%d not picked up by the poller", v)
			}
			time.Sleep(time.Millisecond)
		}
	}
	wg.Wait()
	close(stop)
	<-done
}
