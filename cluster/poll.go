package cluster

import (
	"time"

	"go.uber.org/zap"
)

// Poll calls read with the member list every interval until done is
// closed: every 50ms until the app's serf member runs (it starts after
// every module is provisioned), then every interval. A read that panics
// is logged and ends the polling; whatever read built last stays. It is
// the member source of modules that keep a list built from the members
// (partition's serf_tag); run it in its own goroutine.
func (a *App) Poll(done <-chan struct{}, every time.Duration, logger *zap.Logger, read func([]Member)) {
	defer func() {
		if r := recover(); r != nil {
			logger.Error("cluster member watcher panicked; the list built from the members will no longer be updated",
				zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	wait := 50 * time.Millisecond
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
		}
		if ms, err := a.Members(); err == nil {
			read(ms)
			wait = every
		}
		t.Reset(wait)
	}
}
