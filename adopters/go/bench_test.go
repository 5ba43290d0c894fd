package pdpolicy

import (
	"math"
	"math/rand"
	"testing"
)

// benchPolicy mirrors controller/cli/bench_decide.py's random_policy: the default
// 10 x 10 x 10 axes, a random route and score per cell, exploration 0.05 everywhere.
func benchPolicy(seed int64) *Policy {
	rng := rand.New(rand.NewSource(seed))
	p := &Policy{Version: 1, WTFT: 1, WTPOT: 1, SLOTTFT: 2, SLOTPOT: 0.1, Default: PrefillNode,
		Overrides: Overrides{FirstTurnRoute: PrefillNode},
		Axes: Axes{
			ContextTokens: []float64{256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072},
			IORatio:       []float64{0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64},
			QPS:           []float64{0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256},
		}}
	for i := 0; i < 1000; i++ {
		p.Routes = append(p.Routes, Route(1+rng.Intn(2)))
		p.Scores = append(p.Scores, rng.Float64()*2-1)
		p.Exploration = append(p.Exploration, 0.05)
	}
	p.Checksum = Checksum(p)
	return p
}

// benchFeatures mirrors random_features: valid later turns spread log-uniformly over every
// bin, so each call takes the full table path (three bisections and an exploration draw).
func benchFeatures(seed int64, n int) []Features {
	rng := rand.New(rand.NewSource(seed))
	u := func(lo, hi float64) float64 { return math.Pow(10, lo+rng.Float64()*(hi-lo)) }
	out := make([]Features, n)
	for i := range out {
		out[i] = Features{Turn: int64(2 + rng.Intn(11)), ContextTokens: u(1, 5.5),
			AppendTokens: u(0, 3.5), ExpectedOutputTokens: u(0, 3), QPS: u(-1, 2.7)}
	}
	return out
}

var sink Decision

// BenchmarkDecide: the pure decision (Policy.Decide) with a math/rand draw.
func BenchmarkDecide(b *testing.B) {
	p := benchPolicy(1)
	fs := benchFeatures(2, 8192)
	rng := rand.New(rand.NewSource(3))
	draw := rng.Float64
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sink = p.Decide(fs[i&8191], draw)
	}
}

// BenchmarkWatcherDecideCounted: what a router runs per request: the policy in force read
// from the watcher's atomic pointer, the decision, and its pdrouter_decisions_total tick.
func BenchmarkWatcherDecideCounted(b *testing.B) {
	w := &Watcher{}
	w.current.Store(benchPolicy(1))
	m := NewMetrics()
	fs := benchFeatures(2, 8192)
	rng := rand.New(rand.NewSource(3))
	draw := rng.Float64
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d := w.Decide(fs[i&8191], draw)
		m.CountDecision(d)
		sink = d
	}
}

// BenchmarkDecideParallel: the same from every CPU at once (the policy is shared, the
// counters are atomic).
func BenchmarkDecideParallel(b *testing.B) {
	w := &Watcher{}
	w.current.Store(benchPolicy(1))
	m := NewMetrics()
	fs := benchFeatures(2, 8192)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		rng := rand.New(rand.NewSource(4))
		i := 0
		for pb.Next() {
			m.CountDecision(w.Decide(fs[i&8191], rng.Float64))
			i++
		}
	})
}

func TestBenchPolicyIsValid(t *testing.T) {
	if p := benchPolicy(1); len(p.Routes) != 1000 || p.Decide(benchFeatures(2, 1)[0],
		func() float64 { return 0.9 }).Reason != ReasonTable {
		t.Fatal("bench policy does not take the table path")
	}
}
