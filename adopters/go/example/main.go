// Command example is a minimal Go router that decides in-process with pd-controller's
// policy and exports the pdrouter_* metrics the daemon reads, written by hand as
// Prometheus text (no client library: only the standard library is used).
//
// It is the wiring a real router copies (docs/adopting.md):
//
//  1. `pdctl router-agent --state-file FILE` receives the controller's pushes and persists
//     each applied policy to FILE atomically; this process watches FILE (-policy) and swaps
//     the policy in force when it changes.
//  2. Per request: compute the features, Decide, count the decision, send the request the
//     decided way (here: the caller does, /decide only answers the route).
//  3. Per completed request: Observe it with its TTFT and TPOT (here: POST /complete), so
//     the daemon learns from this router's /metrics.
//
// Endpoints (loopback by default): GET /metrics; POST /decide with the features as JSON
// (turn, context_tokens, append_tokens, expected_output_tokens, optional qps and
// prefill_waiting) answers {route, reason, cell, explored}; POST /complete with the same
// features plus route, ttft_s and tpot_s (null: one output token) answers {slo}.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math"
	"math/rand"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	pdpolicy "github.com/pd-controller/pd-controller/adopters/go"
)

type request struct {
	Turn                 int64    `json:"turn"`
	ContextTokens        float64  `json:"context_tokens"`
	AppendTokens         float64  `json:"append_tokens"`
	ExpectedOutputTokens float64  `json:"expected_output_tokens"`
	QPS                  *float64 `json:"qps"`
	PrefillWaiting       *float64 `json:"prefill_waiting"`
	// /complete only
	Route string   `json:"route"`
	TTFTS float64  `json:"ttft_s"`
	TPOTS *float64 `json:"tpot_s"`
}

// qpsMeter is the router's own arrival rate: arrivals in the last window / window, as
// controller/rollout/qps.py (a sliding window, not a cumulative average).
type qpsMeter struct {
	mu       sync.Mutex
	window   time.Duration
	arrivals []time.Time
}

func (q *qpsMeter) arrive(now time.Time) float64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.arrivals = append(q.arrivals, now)
	cut := 0
	for cut < len(q.arrivals) && !q.arrivals[cut].After(now.Add(-q.window)) {
		cut++
	}
	q.arrivals = q.arrivals[cut:]
	return float64(len(q.arrivals)) / q.window.Seconds()
}

type router struct {
	watcher *pdpolicy.Watcher
	metrics *pdpolicy.Metrics
	qps     *qpsMeter
	rngMu   sync.Mutex
	rng     *rand.Rand
}

func (r *router) draw() float64 {
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.Float64()
}

func (rq *request) features(qps float64) pdpolicy.Features {
	f := pdpolicy.Features{Turn: rq.Turn, ContextTokens: rq.ContextTokens,
		AppendTokens: rq.AppendTokens, ExpectedOutputTokens: rq.ExpectedOutputTokens, QPS: qps,
		PrefillWaiting: math.NaN()}
	if rq.QPS != nil {
		f.QPS = *rq.QPS
	}
	if rq.PrefillWaiting != nil {
		f.PrefillWaiting = *rq.PrefillWaiting
	}
	return f
}

func (r *router) decide(w http.ResponseWriter, req *http.Request) {
	var rq request
	if err := json.NewDecoder(req.Body).Decode(&rq); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	f := rq.features(r.qps.arrive(time.Now()))
	d := r.watcher.Decide(f, r.draw)
	r.metrics.CountDecision(d)
	r.metrics.SetQPS(f.QPS)
	var cell any
	if d.HasCell {
		cell = d.Cell
	}
	writeJSON(w, map[string]any{"route": d.Route.String(), "reason": d.Reason.String(),
		"cell": cell, "explored": d.Explored})
}

func (r *router) complete(w http.ResponseWriter, req *http.Request) {
	var rq request
	if err := json.NewDecoder(req.Body).Decode(&rq); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	route, err := pdpolicy.ParseRoute(rq.Route)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	sloTTFT, sloTPOT := 2.0, 0.1 // the format's defaults while no policy is loaded
	if p := r.watcher.Policy(); p != nil {
		sloTTFT, sloTPOT = p.SLOTTFT, p.SLOTPOT
	}
	tpot := 0.0
	if rq.TPOTS != nil {
		tpot = *rq.TPOTS
	}
	label := r.metrics.Observe(pdpolicy.Decision{Route: route}, rq.features(0), rq.TTFTS, tpot,
		rq.TPOTS != nil, sloTTFT, sloTPOT)
	writeJSON(w, map[string]string{"slo": label})
}

func (r *router) serveMetrics(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	if err := r.metrics.WriteText(w, r.watcher); err != nil {
		log.Printf("metrics: %v", err)
	}
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func main() {
	policy := flag.String("policy", "", "the policy file `pdctl router-agent` persists (--state-file)")
	listen := flag.String("listen", "127.0.0.1:9300", "address of /metrics, /decide, /complete")
	poll := flag.Duration("poll", pdpolicy.DefaultPollInterval, "how often the policy file is checked")
	seed := flag.Int64("seed", time.Now().UnixNano(), "exploration draws' random seed")
	flag.Parse()
	if *policy == "" {
		fmt.Fprintln(os.Stderr, "example: -policy FILE is required")
		os.Exit(2)
	}
	r := &router{
		watcher: pdpolicy.NewWatcher(*policy, *poll),
		metrics: pdpolicy.NewMetrics(),
		qps:     &qpsMeter{window: 10 * time.Second},
		rng:     rand.New(rand.NewSource(*seed)),
	}
	if err := r.watcher.LastError(); err != nil {
		log.Printf("no policy yet (%v): deciding %s until one is readable", err,
			pdpolicy.PrefillNode)
	}
	go r.watcher.RunUntil(make(chan struct{}))
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", r.serveMetrics)
	mux.HandleFunc("/decide", r.decide)
	mux.HandleFunc("/complete", r.complete)
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("listening on %s\n", ln.Addr()) // the address, for callers that asked for port 0
	log.Fatal(http.Serve(ln, mux))
}
